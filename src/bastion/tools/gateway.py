"""MCP wiring of the gateway tools: `<gateway>_<action>` and `<gateway>_actions`.

Wiring only: arguments are checked by `bastion.gateway.actions`, approvals are decided by
`bastion.safety.approvals`, the host is reached by `bastion.gateway.client`, and the
target's dispatch.py has the last word. An action marked `approval = true` sends nothing
until a human approves the exact literal; a denied, expired or already used approval
never sends anything. The approval is spent once the session slot and the connection are
there, just before the session opens; if the host then refuses the session (nothing was
sent), it is given back, both steps audited. An elicited decision is audited before it counts.

With `[approvals] elicitation = true` and a client that declared form elicitation, the
request is also put to the user through elicitation, on both protocol eras: on the
2025-11-25 handshake the call body asks with `ctx.elicit` and waits for the answer, a
decision made elsewhere, or the approval's expiry; on 2026-07-28, where `ctx.elicit`
does not exist, two resolvers find or create the pending approval and ask about it through
`InputRequiredResult`, and the call body gets the answer on the client's retry. Either way
the question names the approval id and the exact literal, and the answer decides only that
approval, which `consume` then binds to the literal being sent.
"""

from __future__ import annotations

import inspect
import logging
import time
import weakref
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import anyio
from mcp.server.elicitation import (
    AcceptedElicitation,
    CancelledElicitation,
    DeclinedElicitation,
    ElicitationResult,
)
from mcp.server.mcpserver import Context, Elicit, Resolve
from mcp_types import ToolAnnotations
from mcp_types.version import is_version_at_least
from pydantic import BaseModel, Field

from bastion.config import ApprovalsConfig, GatewayActionConfig, GatewayConfig
from bastion.gateway.actions import GatewayCommand, build_command
from bastion.safety.approvals import (
    MAX_PENDING_PER_REQUESTER,
    Approval,
    ApprovalQueue,
    new_approval_id,
    raise_for_state,
)
from bastion.safety.errors import BastionError, ConfigError, Conflict, InvalidRequest
from bastion.safety.results import OperationResult, ResultCode
from bastion.tools._call import CallRunner
from bastion.tools.audited import audited_tool
from bastion.tools.server import GATEWAY_DEPLOY, GATEWAY_READ, BastionServer

if TYPE_CHECKING:  # asyncssh, a seventh of the server's start: loaded only when a gateway is configured
    from bastion.gateway.client import GatewayClient, GatewayOutput

logger = logging.getLogger("bastion.tools.gateway")

APPROVAL_ID = "approval_id"
_RESERVED_ARGS = frozenset({APPROVAL_ID, "ctx"})
# Filled by resolvers, never by the client; config arg names are lower case, so these cannot clash.
_ASKED = "elicitedApproval"
_ANSWER = "elicitedAnswer"
ELICITATION_PREFIX = "elicitation:"
ELICITATION_DENIAL = "declined through elicitation"
# The first protocol revision that elicits through InputRequiredResult rather than ctx.elicit.
_INPUT_REQUIRED_VERSION = "2026-07-28"


class ApproveAnswer(BaseModel):
    """The one field an elicitation asks for."""

    approve: bool = Field(title="Approve", description="Yes runs this exact action once; no denies it.")


def _input_required_era(ctx: Context[Any, Any]) -> bool:
    version = ctx.protocol_version
    return version is not None and is_version_at_least(version, _INPUT_REQUIRED_VERSION)


def _client_elicits(ctx: Context[Any, Any]) -> bool:
    """The client declared form elicitation (a bare `elicitation: {}` means form; url-only does not)."""
    capabilities = ctx.client_capabilities
    elicitation = capabilities.elicitation if capabilities is not None else None
    return elicitation is not None and (elicitation.form is not None or elicitation.url is None)


def _answer(outcome: object) -> bool | None:
    """True to approve, False to deny, None when nothing was asked."""
    if isinstance(outcome, AcceptedElicitation) and isinstance(outcome.data, ApproveAnswer):
        return outcome.data.approve
    if isinstance(outcome, DeclinedElicitation | CancelledElicitation):
        return False
    return None


# <gateway>_actions reads the config only: it sends nothing to the host.
_READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
_READS_REMOTE = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=True)
_CHANGES_REMOTE = ToolAnnotations(
    read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=True
)


def tool_name(gateway: GatewayConfig, action: GatewayActionConfig) -> str:
    return f"{gateway.name}_{action.name}"


def _output_result(name: str, command: GatewayCommand, out: GatewayOutput, extra: dict[str, object]) -> OperationResult:
    detail: dict[str, object] = {
        **extra,
        "literal": command.literal,
        "exit_status": out.exit_status,
        "stdout": out.stdout,
        "stderr": out.stderr,
        "truncated": out.truncated,
    }
    code = ResultCode.OUTPUT_TRUNCATED if out.truncated else ResultCode.OK
    return OperationResult.success(name, detail, code=code)


class _ActionTool:
    """One `<gateway>_<action>` tool: check, (approve), send."""

    def __init__(
        self,
        gateway: GatewayConfig,
        action: GatewayActionConfig,
        client: GatewayClient,
        queue: ApprovalQueue,
        approvals: ApprovalsConfig,
        runner: CallRunner,
    ) -> None:
        self.gateway = gateway
        self.action = action
        self.client = client
        self.queue = queue
        self.approvals = approvals
        self.runner = runner
        self.name = tool_name(gateway, action)

    async def __call__(self, ctx: Context[Any, Any], **kwargs: Any) -> OperationResult:
        approval_id = kwargs.pop(APPROVAL_ID, None)
        asked: Approval | None = kwargs.pop(_ASKED, None)
        answer = _answer(kwargs.pop(_ANSWER, None))
        command = build_command(self.action, {key: str(value) for key, value in kwargs.items()})
        if not self.action.approval:
            out = await self.client.call(command, retry=True, caller=self.runner.identity())
            return _output_result(self.name, command, out, {"gateway": self.gateway.name})
        return await self._with_approval(ctx, command, approval_id, asked, answer)

    async def _with_approval(
        self,
        ctx: Context[Any, Any],
        command: GatewayCommand,
        approval_id: str | None,
        asked: Approval | None = None,
        answer: bool | None = None,
    ) -> OperationResult:
        if asked is not None and answer is not None:
            # Asked through InputRequiredResult (2026-07-28) in an earlier round of this call.
            approval = await self._decide(self._bound(asked, command), answer)
        elif approval_id is None:
            approval = self.queue.request(self.name, command.literal, self.runner.identity(), self.approvals.ttl_s)
            logger.warning("approval %s requested: %s %r", approval.id, self.name, command.literal)
            if self._elicits(ctx) and not _input_required_era(ctx):
                approval = await self._elicit_now(ctx, approval)
        else:
            approval = self.queue.get(approval_id)
            if approval.action != self.name or approval.literal != command.literal:
                raise InvalidRequest(
                    f"approval {approval_id} is for {approval.action} {approval.literal!r}, not this call: "
                    "call without approval_id to ask for a new one"
                )
            # The human approved this caller's request: another client holding the id cannot spend it.
            if approval.requested_by != self.runner.identity():
                raise InvalidRequest(
                    f"approval {approval_id} was asked for by another client: call without approval_id to ask"
                )
        if approval.state == "pending" and self.approvals.wait_s > 0:
            total = self.approvals.wait_s

            async def progress(waited: float, message: str) -> None:
                try:
                    await ctx.report_progress(waited, total, message)
                except Exception:  # a client that cannot take progress still gets the answer
                    logger.debug("progress notification failed", exc_info=True)

            approval = await self.queue.wait(approval.id, total, progress)
        if approval.state == "pending":
            return self._needs_approval(approval)
        raise_for_state(approval)  # denied, expired or used: refused before connecting
        spent = _Spending(self, approval, command)
        out = await self.client.call(
            command, retry=False, caller=self.runner.identity(), before_send=spent.spend, if_unsent=spent.give_back
        )
        used = spent.approval
        extra: dict[str, object] = {"gateway": self.gateway.name, APPROVAL_ID: used.id, "approved_by": used.decided_by}
        return _output_result(self.name, command, out, extra)

    def _elicits(self, ctx: Context[Any, Any]) -> bool:
        return self.approvals.elicitation and _client_elicits(ctx)

    def _question(self, approval: Approval) -> str:
        expires = datetime.fromtimestamp(approval.expires_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return (
            f"Approve sending {approval.literal!r} to gateway {self.gateway.name!r} "
            f"({self.gateway.host}:{self.gateway.port})? Tool {self.name}, approval {approval.id}, "
            f"asked by {approval.requested_by}, expires {expires}. Yes runs it once; no denies it."
        )

    def _bound(self, approval: Approval, command: GatewayCommand) -> Approval:
        """The elicited approval, checked to be this call's own: same tool, same literal, same caller."""
        if (approval.action, approval.literal, approval.requested_by) != (
            self.name,
            command.literal,
            self.runner.identity(),
        ):
            raise InvalidRequest(f"approval {approval.id} is for {approval.action} {approval.literal!r}, not this call")
        return approval

    async def _decide(self, approval: Approval, approve: bool) -> Approval:
        """Record the user's answer (audited first); a decision made elsewhere first (CLI, admin page) or
        expiry stands."""
        by = ELICITATION_PREFIX + self.runner.identity()
        try:
            decided = await self.queue.decide_recorded(
                self.runner.audit,
                approval.id,
                "approve" if approve else "deny",
                by=by,
                channel="elicitation",
                reason="" if approve else ELICITATION_DENIAL,
            )
        except Conflict:
            return self.queue.get(approval.id)
        logger.warning("approval %s %s through elicitation by %s", approval.id, decided.state, by)
        return decided

    async def _elicit_now(self, ctx: Context[Any, Any], approval: Approval) -> Approval:
        """Ask with `ctx.elicit` (handshake era); any failure falls back silently to the queue.

        The question stays open until answered, decided elsewhere (CLI, admin page) or expired.
        """
        if not ctx.session.can_send_request:  # e.g. stateless HTTP: no way to send the question
            return approval
        outcome: ElicitationResult[ApproveAnswer] | None = None
        async with anyio.create_task_group() as tasks:

            async def ask() -> None:
                nonlocal outcome
                try:
                    outcome = await ctx.elicit(self._question(approval), ApproveAnswer)
                except Exception:
                    logger.info("elicitation for approval %s failed; it stays in the queue", approval.id, exc_info=True)
                tasks.cancel_scope.cancel()

            async def watch() -> None:
                await self.queue.wait(approval.id, max(0.0, approval.expires_at - time.time()))
                tasks.cancel_scope.cancel()

            tasks.start_soon(ask)
            tasks.start_soon(watch)
        answer = _answer(outcome)
        return self.queue.get(approval.id) if answer is None else await self._decide(approval, answer)

    async def _to_ask(self, ctx: Context[Any, Any], values: dict[str, str], approval_id: str | None) -> Approval | None:
        """Resolver body (2026-07-28): the pending approval to ask about, found again on every round.

        The oldest pending request for this tool, literal and caller is reused, so the retry finds the
        one the question named; None when nothing is to be asked (the call body then does the rest).
        A new request is audited first: this round never reaches the call runner, whose records would.
        """
        if approval_id is not None or not _input_required_era(ctx) or not self._elicits(ctx):
            return None
        try:
            command = build_command(self.action, values)
        except BastionError:
            return None  # the call body reports the bad argument through the runner
        requester = self.runner.identity()
        # Found by review: with the audit awaited between finding none pending and queueing one, two identical
        # calls at once each queued a request, and the user's two yeses deployed twice.
        async with _asking(self.queue):
            waiting = 0
            for pending in self.queue.pending():
                if (pending.action, pending.literal, pending.requested_by) == (self.name, command.literal, requester):
                    return pending
                waiting += pending.requested_by == requester
            if waiting >= MAX_PENDING_PER_REQUESTER:
                return None  # found by review: the record was written before the queue refused; the body refuses
            new_id = new_approval_id()
            record = {"event": "approval_requested", "tool": self.name, "approval": new_id, "literal": command.literal}
            try:
                # Charged to the caller's audit budget (found by review: a client out of budget flooded these at
                # 95 times its rate); a caller out of budget is refused by the runner, through the call body.
                written = await self.runner.record_outside(
                    {**record, "requested_by": requester, "channel": "elicitation"}
                )
                if written is None:
                    return None
                approval = self.queue.request(
                    self.name, command.literal, requester, self.approvals.ttl_s, approval_id=new_id
                )
            except BastionError:
                # Found by attack: requests reached the queue, the admin page and the webhook unaudited, even with
                # the audit log down. The call body asks instead, through the runner: refused as it says why.
                return None
        logger.warning(
            "approval %s requested (asking through elicitation): %s %r", approval.id, self.name, command.literal
        )
        return approval

    def _needs_approval(self, approval: Approval) -> OperationResult:
        reason = (
            f"{approval.literal!r} waits for a human: approval {approval.id}; once approved, call {self.name} "
            f"again with the same arguments and approval_id={approval.id!r}"
        )
        detail: dict[str, object] = {
            APPROVAL_ID: approval.id,
            "literal": approval.literal,
            "expires_at": approval.expires_at,
            "gateway": self.gateway.name,
        }
        return OperationResult.failure(self.name, ResultCode.NEEDS_APPROVAL, reason, detail)

    def signature(self) -> inspect.Signature:
        params = []
        for arg in self.action.args:
            if arg.name in _RESERVED_ARGS:
                raise ValueError(f"gateway action {self.name}: argument name {arg.name!r} is reserved")
            text = arg.description or arg.name
            described = Field(description=f"{text} (must match {arg.pattern!r})", max_length=128)
            params.append(
                inspect.Parameter(arg.name, inspect.Parameter.KEYWORD_ONLY, annotation=Annotated[str, described])
            )
        if self.action.approval:
            described = Field(description="The id NEEDS_APPROVAL returned, once a human approved it.", max_length=64)
            params.append(
                inspect.Parameter(
                    APPROVAL_ID,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=None,
                    annotation=Annotated[str | None, described],
                )
            )
        params.append(inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=Context))
        return inspect.Signature(params, return_annotation=OperationResult)

    def description(self) -> str:
        text = self.action.description or f"Run the action {self.action.name!r} on the production host."
        words = " ".join(f"<{arg.name}>" for arg in self.action.args)
        sent = f"Sends '{self.action.name}{' ' + words if words else ''}' to gateway {self.gateway.name!r}"
        if self.action.approval:
            return (
                f"{text} {sent} after a human approves it: the call waits for the decision, or returns "
                "NEEDS_APPROVAL with an approval_id to pass on a later call with the same arguments."
            )
        return f"{text} {sent}. A non-zero exit status is ok=true with the status in detail.exit_status."

    def as_function(self) -> Any:
        """The tool's body: a plain async function with this action's typed signature, for `audited_tool`."""

        async def handler(ctx: Context[Any, Any], **kwargs: Any) -> OperationResult:
            return await self(ctx, **kwargs)

        handler.__name__ = self.name
        signature = self.signature()
        handler.__annotations__ = {"ctx": Context, "return": OperationResult}
        if self.action.approval and self.approvals.elicitation:
            resolved = self._resolvers(signature)
            handler.__annotations__.update(resolved)
            extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a) for n, a in resolved.items()]
            signature = signature.replace(parameters=[*signature.parameters.values(), *extra])
        handler.__signature__ = signature  # type: ignore[attr-defined]
        return handler

    def _resolvers(self, signature: inspect.Signature) -> dict[str, Any]:
        """The two resolver-filled parameters that carry elicitation on the 2026-07-28 protocol."""

        async def to_ask(ctx: Context[Any, Any], **kwargs: Any) -> Approval | None:
            approval_id = kwargs.pop(APPROVAL_ID, None)
            return await self._to_ask(ctx, {key: str(value) for key, value in kwargs.items()}, approval_id)

        # The resolver takes the ctx and this tool's arguments by name (the SDK reads its signature).
        to_ask.__signature__ = signature.replace(return_annotation=inspect.Signature.empty)  # type: ignore[attr-defined]
        to_ask.__annotations__ = {"ctx": Context}
        asked = Annotated[Approval | None, Resolve(to_ask)]

        async def question(approval: Approval | None) -> Elicit[ApproveAnswer] | None:
            return None if approval is None else Elicit(self._question(approval), ApproveAnswer)

        question.__annotations__ = {"approval": asked}
        return {_ASKED: asked, _ANSWER: Annotated[ElicitationResult[ApproveAnswer], Resolve(question)]}


class _Spending:
    """Spends one approval just before its literal is sent, and gives it back if nothing was sent."""

    def __init__(self, tool: _ActionTool, approval: Approval, command: GatewayCommand) -> None:
        self.tool = tool
        self.approval = approval
        self.command = command
        self.spent = False

    async def spend(self) -> None:
        """Called once the session slot and the connection are there: a refusal before this spends nothing."""
        tool = self.tool
        used = tool.queue.consume(self.approval.id, tool.name, self.command.literal)  # denied, expired or used
        self.approval, self.spent = used, True
        # The human decision joins the hash chain before the action is sent; if it cannot, nothing is sent.
        await tool.runner.audit.append_async(
            {
                "event": "approval_used",
                "tool": tool.name,
                "approval": used.id,
                "literal": used.literal,
                "requested_by": used.requested_by,
                "decided_by": used.decided_by,
            }
        )

    async def give_back(self, error: BastionError) -> None:
        """The session never opened: nothing reached the host, so the approval is not spent (audited first)."""
        if not self.spent:  # refused before it was spent (no slot or connection in time): nothing to give back
            return
        tool, used = self.tool, self.approval
        try:
            await tool.runner.audit.append_async(
                {
                    "event": "approval_returned",
                    "tool": tool.name,
                    "approval": used.id,
                    "literal": used.literal,
                    "why": f"nothing was sent: {error.reason}",
                }
            )
            self.approval = tool.queue.give_back(used.id)
        except BastionError as exc:  # it stays used: the safe side
            logger.warning("approval %s not given back: %s", used.id, exc.reason)
            return
        error.reason = f"{error.reason}; approval {used.id} was not spent: call again with it"
        logger.warning("approval %s given back: %s", used.id, error.reason)


def _actions_detail(gateway: GatewayConfig) -> dict[str, object]:
    return {
        "gateway": gateway.name,
        "host": f"{gateway.host}:{gateway.port}",
        "actions": [
            {
                "tool": tool_name(gateway, action),
                "action": action.name,
                "description": action.description,
                "approval": action.approval,
                "args": [{"name": a.name, "pattern": a.pattern, "description": a.description} for a in action.args],
            }
            for action in gateway.action
        ],
    }


def register_gateway(
    server: BastionServer, clients: Mapping[str, GatewayClient], queue: ApprovalQueue, approvals: ApprovalsConfig
) -> None:
    """Add `<gateway>_actions` and one tool per action of each configured gateway."""
    for client in clients.values():
        gateway = client.config
        _check_free(server, f"{gateway.name}_actions", f"gateway {gateway.name!r} (its list of actions)")
        _register_actions_tool(server, gateway)
        for action in gateway.action:
            tool = _ActionTool(gateway, action, client, queue, approvals, server.runner)
            _check_free(server, tool.name, f"gateway {gateway.name!r} action {action.name!r}")
            audited_tool(
                server,
                tool.name,
                mutating=True,
                description=tool.description(),
                annotations=_CHANGES_REMOTE if action.approval else _READS_REMOTE,
                toolset=GATEWAY_DEPLOY if action.approval else GATEWAY_READ,
                workspace=f"gateway:{gateway.name}",
                title=f"{gateway.name}: {action.name}",
            )(tool.as_function())


_ASKING: weakref.WeakKeyDictionary[ApprovalQueue, anyio.Lock] = weakref.WeakKeyDictionary()
"""One lock per approval queue: every server of the process (a session each) finds or makes requests in turn."""


def _asking(queue: ApprovalQueue) -> anyio.Lock:
    return _ASKING.setdefault(queue, anyio.Lock())


def _check_free(server: BastionServer, name: str, what: str) -> None:
    """Refuse a gateway's tool named as one of bastion's own (gateway "run", action "command": run_command)."""
    if name in server.tool_scopes:
        raise ConfigError(f"{what} makes the tool {name!r}, which bastion already has: rename the gateway or action")


def _register_actions_tool(server: BastionServer, gateway: GatewayConfig) -> None:
    @audited_tool(
        server,
        f"{gateway.name}_actions",
        mutating=False,
        description=(
            f"List what gateway {gateway.name!r} allows: each action's tool, arguments with their patterns, and "
            "whether a human must approve it. Sends nothing to the host."
        ),
        annotations=_READ_ONLY,
        toolset=GATEWAY_READ,
        workspace=f"gateway:{gateway.name}",
        title=f"{gateway.name}: list actions",
    )
    async def list_actions() -> dict[str, object]:
        return _actions_detail(gateway)
