"""The MCP server: the SDK's `MCPServer` with bastion's call contract enforced.

The SDK answers a bad argument or a crashed tool with free text; bastion answers
every call, including those, with an `OperationResult`, and `isError` is true
exactly when `ok` is false. Unknown arguments are refused rather than ignored,
so a client that believes it can pass, say, an environment learns it cannot.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp_types import CallToolResult, ImageContent, InputRequiredResult, TextContent, ToolAnnotations
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from bastion.safety.errors import MAX_SHOWN_CHARS, BastionError, InvalidRequest, shown
from bastion.safety.results import OperationResult, ResultCode
from bastion.tools._call import CallRunner
from bastion.transports.stdio import stdio_streams

MAX_TOOL_NAME_CHARS: Final = 128
"""MCP's tool names are 1 to 128 characters (its naming guidance): an unknown tool's name is cut to it in the answer."""
logger = logging.getLogger("bastion.server")

_F = TypeVar("_F", bound=Callable[..., Any])

# OAuth scopes name toolsets; a tool belongs to exactly one, declared where it is registered.
WORKBENCH: Final = "workbench"
ORGANIZER: Final = "organizer"
GATEWAY_READ: Final = "gateway:read"
GATEWAY_DEPLOY: Final = "gateway:deploy"
SCOPES: Final = (WORKBENCH, ORGANIZER, GATEWAY_READ, GATEWAY_DEPLOY)

_ARGUMENT_HINTS = {
    "env": "the command environment is fixed by the administrator's config; give a sandbox variables with "
    "create_sandbox(env=...)",
}


def to_call_result(result: OperationResult, *, extra: Sequence[ImageContent] = ()) -> CallToolResult:
    """The wire form: the result as structured content and as one JSON text block (then any images).

    The text is pydantic's JSON of the same model: the same value as the structured content, written
    by its Rust serializer (40 KB of file content: 82 us, where `json.dumps` without ASCII escapes took
    350 us on this machine; a read's result is mostly such content).
    """
    payload = result.model_dump(mode="json")
    try:
        text = result.model_dump_json()
    except PydanticSerializationError:
        # What it cannot write (a lone surrogate) is written as before, and the transport decides.
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    content: list[TextContent | ImageContent] = [TextContent(type="text", text=text), *extra]
    return CallToolResult(content=content, structured_content=payload, is_error=not result.ok)


MAX_FIELDS_SHOWN: Final = 8


def _fields(error: ValidationError) -> str:
    """The arguments pydantic refused, by path, each part cut (`shown`) and at most `MAX_FIELDS_SHOWN` of them:
    a path holds the client's dict keys (found by review: a `limits` key of 1.3 M characters came back whole,
    a 7.8 MB answer), and a list of 10,000 bad items is 10,000 paths."""
    paths = sorted({".".join(_part(str(p)) for p in err["loc"]) for err in error.errors()})
    more = len(paths) - MAX_FIELDS_SHOWN
    return ", ".join(paths[:MAX_FIELDS_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _part(text: str) -> str:
    """One part of a refused argument's path: as it is when short and printable, else quoted and cut (a key with
    a newline or an escape sequence would otherwise be written raw into the reason)."""
    return text if len(text) <= MAX_SHOWN_CHARS and text.isprintable() else shown(text)


def default_title(name: str) -> str:
    """A tool's name in words: "run_command" -> "Run command"."""
    words = name.replace("_", " ").strip()
    return words[:1].upper() + words[1:]


class InternalError(BastionError):
    code = ResultCode.INTERNAL_ERROR


class BastionServer(MCPServer[Any]):
    """`MCPServer` whose every tool answer is an `OperationResult`."""

    def __init__(self, runner: CallRunner, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.runner = runner
        self.tool_scopes: dict[str, str] = {}
        """Tool name -> the scope (toolset) a caller needs to see and call it."""
        self.refused_arguments: dict[str, Callable[[dict[str, Any]], dict[str, object]]] = {}
        """Tool name -> what a refused call's arguments are recorded as (its audit rules: `audited_tool`)."""
        self._arguments: dict[str, frozenset[str]] | None = None

    def tool(  # type: ignore[override]
        self,
        name: str,
        *,
        description: str,
        annotations: ToolAnnotations | None = None,
        scope: str = WORKBENCH,
        title: str | None = None,
    ) -> Callable[[_F], _F]:
        """Register a tool under its toolset's scope; every bastion tool names itself, says what it does,
        and has a title for people (default: its name in words, e.g. "Run command")."""
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}")
        if name in self.tool_scopes:
            # The SDK would keep the first tool's body under the second one's scope.
            raise ValueError(f"tool {name!r} is registered twice")
        self.tool_scopes[name] = scope
        self.runner.tools.add(name)
        return super().tool(
            name=name, title=title or default_title(name), description=description, annotations=annotations
        )

    def add_tool(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._arguments = None
        super().add_tool(fn, *args, **kwargs)

    def remove_tool(self, name: str) -> None:
        self._arguments = None
        super().remove_tool(name)

    async def _known_arguments(self, name: str) -> frozenset[str] | None:
        """The argument names a tool takes, None for an unknown tool: read once from the public tools list."""
        if self._arguments is None:
            tools = await self.list_tools()
            self._arguments = {t.name: frozenset(t.input_schema.get("properties", {})) for t in tools}
        return self._arguments.get(name)

    async def run_stdio_async(self) -> None:
        """Serve stdio on bastion's event-loop transport (see `bastion.transports.stdio`)."""
        async with stdio_streams() as (read_stream, write_stream):
            # The SDK runs stdio only on its threaded transport, and makes its low-level server public
            # only as the app of the HTTP session manager: reached there, it serves these streams.
            self.streamable_http_app()
            lowlevel = self.session_manager.app
            await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())

    def _recorded(self, name: str, arguments: dict[str, Any]) -> dict[str, object]:
        """A refused call's arguments as its audit record holds them: by the tool's audit rules (a file's content
        as its length, a dict's keys only), as a call that runs would record them; an unknown tool's as given
        (the record's size bounds them)."""
        recorded = self.refused_arguments.get(name)
        return recorded(arguments) if recorded is not None else arguments

    async def refuse_unknown_tool(self, name: str, arguments: dict[str, Any]) -> CallToolResult:
        """The audited refusal of a call to a tool this server does not have, whichever path saw it first (here, or
        the HTTP scope check: found by attack, that path put a name of 1.3 M characters whole in its answer, 28.6 MB
        for a 3.9 MB request). The reason quotes the name cut (`shown`); the answer's action and the audit record's
        tool are cut to MCP's bound on a tool's name."""
        error = InvalidRequest(f"unknown tool {shown(name)}: list the tools to see what this server offers")
        action = name[:MAX_TOOL_NAME_CHARS]
        return to_call_result(await self.runner.refuse(action, self._recorded(name, arguments), error))

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult | InputRequiredResult:
        known = await self._known_arguments(name)
        if known is None:
            return await self.refuse_unknown_tool(name, arguments)
        unknown = sorted(set(arguments) - known)
        if unknown:
            hint = _ARGUMENT_HINTS.get(unknown[0], f"{name} takes {', '.join(sorted(known)) or 'no arguments'}")
            error = InvalidRequest(f"unknown argument {shown(unknown[0])}: {hint}")
            return to_call_result(await self.runner.refuse(name, self._recorded(name, arguments), error))
        try:
            return await super().call_tool(name, arguments, context)
        except UnexpectedToolError:
            # Tools catch their own errors; reaching here is a bug in bastion, logged with its traceback.
            logger.exception("tool %s failed outside its call runner", name)
            internal = InternalError("internal error; the server log has the details")
            return to_call_result(await self.runner.refuse(name, self._recorded(name, arguments), internal))
        except ToolError as exc:
            cause = exc.__cause__
            if isinstance(cause, ValidationError):
                fields = _fields(cause)
                # A closed vocabulary says what it takes (pydantic's message names the choices, not the input).
                choices = sorted({str(err["msg"]) for err in cause.errors() if err["type"] == "literal_error"})
                hint = f" ({'; '.join(choices)})" if choices else ""
                error = InvalidRequest(f"invalid arguments: {fields}{hint}: check their types and limits")
            else:
                error = InvalidRequest("the tool refused the call")
            return to_call_result(await self.runner.refuse(name, self._recorded(name, arguments), error))
