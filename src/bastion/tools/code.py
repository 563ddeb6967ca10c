"""MCP wiring of code execution: execute_code and list_code_contexts.

Wiring only (`audited_tool`): the contexts live in `bastion.workbench.code`; the sandbox is the boundary.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from typing import Annotated, Final, Literal, TypeVar

from mcp.server.mcpserver import Context
from mcp_types import ImageContent, ToolAnnotations
from pydantic import Field

from bastion.config import SandboxesConfig
from bastion.safety.results import OperationResult, ResultCode
from bastion.tools._call import UNNAMED, Outcome
from bastion.tools.audited import Audit, audited_tool, workspace_of
from bastion.tools.server import BastionServer
from bastion.tools.threads import ThreadShares
from bastion.tools.workbench import command_result
from bastion.workbench.code import CellResult, Image, Language
from bastion.workbench.manager import SandboxManager
from bastion.workbench.media import ImageBudget
from bastion.workbench.packages import install
from bastion.workbench.progress import LineProgress
from bastion.workbench.registry import WorkspaceRegistry

SandboxIdArg = Annotated[str, Field(description="The sandbox id from create_sandbox.")]
# The record's workspace names it, so it is not copied into the audited arguments.
InSandbox = Annotated[str, Field(description="The sandbox id from create_sandbox."), Audit.OMIT]

T = TypeVar("T")
_READS = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
# It reaches the package registry; it adds to the sandbox's own environment (an upgrade replaces a version,
# nothing else), and the same requirement twice leaves the same environment.
_INSTALLS = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=True)
# binascii holds the GIL for one whole call (~3 ms per MiB): encoded in pieces, a worker thread lets the
# event loop in between. A multiple of 3, so that the pieces' encodings join into the whole's.
_BASE64_PIECE_BYTES: Final = 3 << 16


def cell_result(result: CellResult, extra: dict[str, object]) -> OperationResult:
    """An execution as a result: the agent's own exception is data (ok=true, detail.error)."""
    detail: dict[str, object] = {
        **extra,
        "execution_count": result.execution_count,
        "stdout": result.stdout,
        "stderr": result.stderr,
        "value": result.value,
        "markdown": result.markdown,
        "html": result.html,
        "exit_status": result.exit_status,
        "error": result.error,
        "images": [
            {
                "index": i,
                "mime_type": image.mime_type,
                "width": image.width,
                "height": image.height,
                "bytes": len(image.data),
            }
            for i, image in enumerate(result.images)
        ],
        "images_note": result.image_note or None,
        "truncated": result.truncated,
        "context_state": "alive" if result.context_alive else "dead",
    }
    if result.protocol_error:
        # The agent's code wrote to the context's protocol channel: only the context ends, not the sandbox.
        reason = f"the context broke the protocol ({result.protocol_error}) and was killed: run again with restart=true"
        return OperationResult.failure(UNNAMED, ResultCode.OPERATION_FAILED, reason, detail)
    if result.oom_killed:
        note = f" ({result.memory_note})" if result.memory_note else ""
        reason = f"the context ran out of memory and was killed{note}: run again with restart=true"
        return OperationResult.failure(UNNAMED, ResultCode.RESOURCE_LIMIT, reason, detail)
    if result.timed_out:
        reason = (
            "the code hit its time limit and was interrupted; the context is alive"
            if result.context_alive
            else "the code hit its time limit and did not stop: the context was killed (restart=true)"
        )
        return OperationResult.failure(UNNAMED, ResultCode.TIMEOUT, reason, detail)
    if not result.context_alive and result.error is None:
        reason = "the context ended while running the code (it exited or was killed): run again with restart=true"
        return OperationResult.failure(UNNAMED, ResultCode.OPERATION_FAILED, reason, detail)
    code = ResultCode.OUTPUT_TRUNCATED if result.truncated else ResultCode.OK
    return OperationResult.success(UNNAMED, detail, code=code)


def image_contents(images: list[Image]) -> list[ImageContent]:
    """The images as MCP content, base64-encoded (run in a worker thread: up to MAX_CELL_IMAGE_BYTES)."""
    return [ImageContent(type="image", data=_base64(image.data), mime_type=image.mime_type) for image in images]


def _base64(data: bytes) -> str:
    view = memoryview(data)
    pieces = (base64.b64encode(view[at : at + _BASE64_PIECE_BYTES]) for at in range(0, len(data), _BASE64_PIECE_BYTES))
    return b"".join(pieces).decode("ascii")


def register_code(
    server: BastionServer,
    sandboxes: SandboxManager,
    registry: WorkspaceRegistry,
    config: SandboxesConfig,
    threads: ThreadShares,
) -> None:
    """Add the code tools to `server`; install_package only if the config names a package registry. A cell's
    images and texts are cleaned, and its images encoded, in `threads`' shares of the sandbox and the caller."""
    in_sandbox = workspace_of("sandbox_id")
    # One per server (a process serves one): the image bytes its code calls hold, all sandboxes together.
    image_budget = ImageBudget()
    network = bool(config.network.allow)
    runs = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False, open_world_hint=network)

    def sandbox_only(sandbox_id: str, what: str) -> None:
        # FORBIDDEN, as every sandbox-only operation on a host workspace (`HostWorkspace.require_sandbox`).
        registry.resolve(sandbox_id).workspace.require_sandbox(what)

    @audited_tool(
        server,
        "execute_code",
        mutating=True,
        annotations=runs,
        workspace=in_sandbox,
        title="Execute code",
        description=(
            "Run code in a sandbox, in a persistent context (like a notebook kernel) of one of three languages: "
            "python (default), javascript (node) or bash. State stays between calls to the same context: Python "
            "variables, imports and open files; JavaScript globals (let/const too) and require()d modules (top-level "
            "await works; that cell's declarations stay local); bash "
            "variables, functions and the working folder. The value of a last expression comes back in "
            "detail.value (Python: its repr; a pandas DataFrame also as a markdown table in detail.markdown, and "
            "anything with _repr_markdown_/_repr_html_ in detail.markdown/detail.html; _repr_svg_/_repr_png_ and "
            "matplotlib figures left open as images); bash gives the cell's $? in detail.exit_status. An exception "
            "comes back with its traceback in detail.error (ok stays true: it is your code's error). Named "
            "contexts per language (context='default'); restart=true starts one afresh. Code running longer than a "
            "second sends progress notifications with the end of its output so far. On timeout the code is "
            "interrupted (Python: KeyboardInterrupt; bash and node: SIGINT) and the context lives; if it does not "
            "stop within 5 s, or exits (exit, process.exit), the context ends: run again with restart=true."
        ),
    )
    async def execute_code(
        code: Annotated[str, Field(description="The code to run.")],
        sandbox_id: InSandbox,
        ctx: Context,
        language: Annotated[
            Language, Field(description="python, javascript (node) or bash. Default: python.")
        ] = "python",
        context: Annotated[str, Field(description="The context's name, per language.")] = "default",
        restart: Annotated[bool, Field(description="Kill the context first, start a fresh one.")] = False,
        timeout_s: Annotated[float | None, Field(description="Wall-clock limit; capped by the sandbox's.")] = None,
    ) -> OperationResult | Outcome:
        ticks = [0]

        async def progress(tail: str) -> None:
            ticks[0] += 1
            await ctx.report_progress(ticks[0], None, tail or "running; no output yet")

        sandbox_only(sandbox_id, "execute_code")
        box = sandboxes.get(sandbox_id)
        in_thread = threads.binding(registry.get(sandbox_id))

        # The lease holds the images' bytes until this returns: not while the transport sends the answer.
        with image_budget.lease() as lease:
            result = await box.code.run(
                code,
                language=language,
                context=context,
                restart=restart,
                timeout_s=timeout_s,
                progress=progress,
                images=lease,
                in_thread=in_thread,
            )
            images = await in_thread(functools.partial(image_contents, result.images)) if result.images else []
            return Outcome(cell_result(result, {"language": language, "context": context}), images=images)

    @audited_tool(
        server,
        "list_code_contexts",
        mutating=False,
        annotations=_READS,
        workspace=in_sandbox,
        title="List code contexts",
        description="The code contexts of a sandbox: name, language, state (idle, busy, dead), executions, age.",
    )
    async def list_code_contexts(sandbox_id: SandboxIdArg) -> dict[str, object]:
        sandbox_only(sandbox_id, "list_code_contexts")
        return {"contexts": sandboxes.get(sandbox_id).code.contexts()}

    if config.network.registry:
        _register_install(server, sandboxes, config, sandbox_only)


def _register_install(
    server: BastionServer,
    sandboxes: SandboxManager,
    config: SandboxesConfig,
    sandbox_only: Callable[[str, str], None],
) -> None:
    @audited_tool(
        server,
        "install_package",
        mutating=True,
        annotations=_INSTALLS,
        workspace=workspace_of("sandbox_id"),
        title="Install package",
        description=(
            "Install a package into a sandbox's own environment, inside the sandbox. pip: a requirement such as "
            "'requests' or 'requests[socks]>=2.31' goes into /workspace/.venv (on PATH; execute_code sees it); "
            "npm: a name such as 'lodash@^4' goes into /workspace/node_modules (install scripts do not run). "
            "Only the package registry is reachable during the install. Options, URLs, paths and VCS links are "
            "refused. Sends progress notifications (each step, then the installer's newest output line, redacted) "
            "while it runs."
        ),
    )
    async def install_package(
        name: Annotated[str, Field(description="The requirement: a package name, optional extras and version.")],
        sandbox_id: InSandbox,
        ctx: Context,
        manager: Annotated[Literal["pip", "npm"], Field(description="Default: pip.")] = "pip",
    ) -> OperationResult:
        sandbox_only(sandbox_id, "install_package")
        box = sandboxes.get(sandbox_id)

        async def send(count: float, message: str) -> None:
            await ctx.report_progress(count, None, message)  # a no-op for a client that sent no progressToken

        async with LineProgress(box.workspace.redactor, send).running() as progress:
            requirement, out = await install(box, name, manager, config, progress)
        result = command_result(out, {"requirement": requirement, "manager": manager})
        if result.ok and out.exit_status != 0:
            reason = f"{manager} could not install {requirement!r} (exit {out.exit_status}): see detail.stderr"
            return OperationResult.failure(UNNAMED, ResultCode.OPERATION_FAILED, reason, result.detail)
        return result
