"""MCP wiring of the gateway tools: `<gateway>_<action>` and `<gateway>_actions`.

Wiring only: arguments are checked by `bastion.gateway.actions`, approvals are decided by
`bastion.safety.approvals`, the host is reached by `bastion.gateway.client`, and the
target's dispatch.py has the last word. An action marked `approval = true` sends nothing
until a human approves the exact literal; a denied, expired or already used approval
never sends anything.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Annotated, Any

from mcp.server.mcpserver import Context
from mcp_types import CallToolResult, ToolAnnotations
from pydantic import Field

from bastion.config import ApprovalsConfig, GatewayActionConfig, GatewayConfig
from bastion.gateway.actions import GatewayCommand, build_command
from bastion.gateway.client import GatewayClient, GatewayOutput
from bastion.safety.approvals import Approval, ApprovalQueue
from bastion.safety.errors import InvalidRequest
from bastion.safety.results import OperationResult, ResultCode
from bastion.tools._call import CallRunner
from bastion.tools.server import GATEWAY_DEPLOY, GATEWAY_READ, BastionServer, to_call_result

logger = logging.getLogger("bastion.tools.gateway")

Result = Annotated[CallToolResult, OperationResult]
APPROVAL_ID = "approval_id"
_RESERVED_ARGS = frozenset({APPROVAL_ID, "ctx"})

_READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=True)
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

    async def __call__(self, ctx: Context[Any, Any], **kwargs: Any) -> CallToolResult:
        approval_id = kwargs.pop(APPROVAL_ID, None)
        values = {key: str(value) for key, value in kwargs.items()}

        async def op() -> OperationResult:
            command = build_command(self.action, values)
            if not self.action.approval:
                out = await self.client.call(command, retry=True)
                return _output_result(self.name, command, out, {"gateway": self.gateway.name})
            return await self._with_approval(ctx, command, approval_id)

        args: dict[str, object] = {**values, APPROVAL_ID: approval_id} if self.action.approval else dict(values)
        result = await self.runner.run(self.name, args, op, mutating=True, workspace=f"gateway:{self.gateway.name}")
        return to_call_result(result)

    async def _with_approval(
        self, ctx: Context[Any, Any], command: GatewayCommand, approval_id: str | None
    ) -> OperationResult:
        if approval_id is None:
            approval = self.queue.request(self.name, command.literal, self.runner.identity(), self.approvals.ttl_s)
            logger.warning("approval %s requested: %s %r", approval.id, self.name, command.literal)
        else:
            approval = self.queue.get(approval_id)
            if approval.action != self.name or approval.literal != command.literal:
                raise InvalidRequest(
                    f"approval {approval_id} is for {approval.action} {approval.literal!r}, not this call: "
                    "call without approval_id to ask for a new one"
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
        used = self.queue.consume(approval.id, self.name, command.literal)  # raises if denied, expired or used
        # The human decision joins the hash chain before the action is sent; if it cannot, nothing is sent.
        await self.runner.audit.append_async(
            {
                "event": "approval_used",
                "tool": self.name,
                "approval": used.id,
                "literal": used.literal,
                "requested_by": used.requested_by,
                "decided_by": used.decided_by,
            }
        )
        out = await self.client.call(command, retry=False)
        extra: dict[str, object] = {"gateway": self.gateway.name, APPROVAL_ID: used.id, "approved_by": used.decided_by}
        return _output_result(self.name, command, out, extra)

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
        return inspect.Signature(params, return_annotation=Result)

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
        """A plain async function with this action's typed signature, for the SDK's tool registry."""

        async def handler(ctx: Context[Any, Any], **kwargs: Any) -> CallToolResult:
            return await self(ctx, **kwargs)

        handler.__name__ = self.name
        handler.__signature__ = self.signature()  # type: ignore[attr-defined]
        handler.__annotations__ = {"ctx": Context, "return": Result}
        return handler


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
    server: BastionServer,
    clients: Mapping[str, GatewayClient],
    queue: ApprovalQueue,
    approvals: ApprovalsConfig,
    runner: CallRunner,
) -> None:
    """Add `<gateway>_actions` and one tool per action of each configured gateway."""
    for client in clients.values():
        gateway = client.config
        _register_actions_tool(server, gateway, runner)
        for action in gateway.action:
            tool = _ActionTool(gateway, action, client, queue, approvals, runner)
            server.tool(
                name=tool.name,
                description=tool.description(),
                annotations=_CHANGES_REMOTE if action.approval else _READS_REMOTE,
                scope=GATEWAY_DEPLOY if action.approval else GATEWAY_READ,
            )(tool.as_function())


def _register_actions_tool(server: BastionServer, gateway: GatewayConfig, runner: CallRunner) -> None:
    name = f"{gateway.name}_actions"

    @server.tool(
        name=name,
        description=(
            f"List what gateway {gateway.name!r} allows: each action's tool, arguments with their patterns, and "
            "whether a human must approve it. Sends nothing to the host."
        ),
        annotations=_READ_ONLY,
        scope=GATEWAY_READ,
    )
    async def list_actions() -> Result:
        async def op() -> OperationResult:
            return OperationResult.success(name, _actions_detail(gateway))

        return to_call_result(await runner.run(name, {}, op, mutating=False, workspace=f"gateway:{gateway.name}"))
