"""`audited_tool`: a tool declared once, run under the call runner, audited from its own signature.

The decorated function is the tool's body: it takes the tool's arguments and returns a success's
detail, an `OperationResult`, or an `Outcome` (to name the files it touched). The decorator registers
it under its toolset, records the call's bound arguments (a marker on a parameter's annotation says
what is not copied whole), runs the body under `CallRunner` with the tool's name, and answers in the
wire form. Parameter names, types, defaults and descriptions are the tool's input schema, as before.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping
from enum import Enum
from typing import Annotated, Any, get_args, get_origin

from mcp.server.mcpserver import Context, Resolve
from mcp_types import CallToolResult, ImageContent, ToolAnnotations
from pydantic import BaseModel

from bastion.safety.arguments import require_sound
from bastion.safety.results import OperationResult
from bastion.tools._call import Outcome
from bastion.tools.server import WORKBENCH, BastionServer, to_call_result

Result = Annotated[CallToolResult, OperationResult]
Body = Callable[..., Awaitable[dict[str, Any] | OperationResult | Outcome]]
WorkspaceOf = Callable[[Mapping[str, Any]], str | None]
"""The record's workspace, from the call's bound arguments."""


class Audit(Enum):
    """How an argument goes into the audit record: `Annotated[T, ..., Audit.LENGTH]`. Unmarked: as is."""

    OMIT = "omit"  # a secret, or the argument the record's workspace already names
    LENGTH = "length"  # content too large to copy: recorded as `<name>_chars`, its length
    KEYS = "keys"  # contents by name (e.g. files by path): recorded as the sorted names


def workspace_of(argument: str, resolve: Callable[[Any], str | None] | None = None) -> WorkspaceOf:
    """The workspace named by `argument`, resolved if need be (e.g. None to the default workspace's id)."""

    def of(arguments: Mapping[str, Any]) -> str | None:
        value = arguments[argument]
        return resolve(value) if resolve is not None else value

    return of


def audited_tool(
    server: BastionServer,
    name: str,
    *,
    mutating: bool,
    description: str,
    annotations: ToolAnnotations,
    toolset: str = WORKBENCH,
    workspace: str | WorkspaceOf | None = None,
    title: str | None = None,
) -> Callable[[Body], Body]:
    """Register `body` as the tool `name`, in `toolset`, audited as mutating or not, shown as `title`."""

    def register(body: Body) -> Body:
        signature = inspect.signature(body, eval_str=True)
        rules = {p.name: _rule(p.annotation) for p in signature.parameters.values()}
        given = tuple(p.name for p in signature.parameters.values() if _from_client(p.annotation))
        bind = binder(signature)

        async def tool(**kwargs: Any) -> CallToolResult:
            arguments = bind(kwargs)
            images: list[ImageContent] = []

            async def operation() -> OperationResult | Outcome:
                for argument in given:
                    require_sound(argument, arguments[argument])
                done = await body(**arguments)
                if isinstance(done, Outcome):
                    images.extend(done.images)
                return OperationResult.success(name, done) if isinstance(done, dict) else done

            where = workspace(arguments) if callable(workspace) else workspace
            audited = _audited(arguments, rules)
            result = await server.runner.run(name, audited, operation, mutating=mutating, workspace=where)
            return to_call_result(result, extra=images)

        functools.update_wrapper(tool, body)
        # The SDK reads the input schema from these: the body's own parameters, answered in the wire form.
        tool.__signature__ = signature.replace(return_annotation=Result)  # type: ignore[attr-defined]
        hints = {p.name: p.annotation for p in signature.parameters.values() if p.annotation is not p.empty}
        tool.__annotations__ = {**hints, "return": Result}
        server.tool(name, description=description, annotations=annotations, scope=toolset, title=title)(tool)
        server.refused_arguments[name] = functools.partial(_refused, rules=rules)
        return body

    return register


def binder(signature: inspect.Signature) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """What `signature.bind(**kwargs)` then `apply_defaults()` give as `arguments`, for keyword calls.

    The SDK calls a tool with every parameter by name, already validated: binding them again through
    `inspect` cost ~8 us a call. A call that is not that plain (a missing or unknown name, or a body
    taking ``*args`` or ``**kwargs``) still goes through `Signature.bind`, which raises the same error.
    """
    parameters = signature.parameters.values()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if any(p.kind not in keyword for p in parameters):
        return lambda kwargs: _bound(signature, kwargs)
    names = tuple(p.name for p in parameters)
    known = frozenset(names)
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}
    required = known - defaults.keys()

    def bind(kwargs: Mapping[str, Any]) -> dict[str, Any]:
        given = kwargs.keys()
        if not (required <= given <= known):
            return _bound(signature, kwargs)
        return {name: kwargs[name] if name in kwargs else defaults[name] for name in names}

    return bind


def _bound(signature: inspect.Signature, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    bound = signature.bind(**kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _from_client(annotation: object) -> bool:
    """Whether a parameter is the client's to give (not the SDK's context, nor a resolver's value)."""
    if _is_context(annotation):
        return False
    return get_origin(annotation) is not Annotated or not any(isinstance(m, Resolve) for m in get_args(annotation)[1:])


def _rule(annotation: object) -> Audit | None:
    """OMIT for what the client does not send (the context, resolver-filled values) and marked secrets."""
    if _is_context(annotation):
        return Audit.OMIT
    if get_origin(annotation) is not Annotated:
        return None
    metadata = get_args(annotation)[1:]
    if any(isinstance(m, Resolve) for m in metadata):
        return Audit.OMIT
    return next((m for m in metadata if isinstance(m, Audit)), None)


def _is_context(annotation: object) -> bool:
    kind = get_origin(annotation) or annotation
    return inspect.isclass(kind) and issubclass(kind, Context)


def _audited(arguments: Mapping[str, Any], rules: Mapping[str, Audit | None]) -> dict[str, object]:
    audited: dict[str, object] = {}
    for key, value in arguments.items():
        rule = rules[key]
        if rule is Audit.OMIT:
            continue
        if rule is Audit.LENGTH:
            audited[f"{key}_chars"] = len(value)
        elif rule is Audit.KEYS:
            audited[key] = sorted(value or {})
        elif isinstance(value, BaseModel):
            audited[key] = value.model_dump(exclude_none=True)
        else:
            audited[key] = value
    return audited


def _refused(arguments: dict[str, Any], *, rules: Mapping[str, Audit | None]) -> dict[str, object]:
    """`_audited` for a call refused before it ran: its values may be of any type (they failed validation), and
    names the tool does not take are kept as given. Without it, a refused upload_file recorded the file's
    content itself, and a refused create_run_close its files' contents."""
    audited: dict[str, object] = {}
    for key, value in arguments.items():
        rule = rules.get(key)
        if rule is Audit.OMIT:
            continue
        if rule is Audit.LENGTH:
            audited[f"{key}_chars"] = len(value) if isinstance(value, str | bytes | list | dict) else None
        elif rule is Audit.KEYS:
            audited[key] = sorted(str(k) for k in value) if isinstance(value, dict) else type(value).__name__
        else:
            audited[key] = value
    return audited
