"""Command policy: parse a command line into argv, then decide whether it may run.

The command line is split into argv by a small quote-aware tokenizer, WITHOUT a
shell: nothing here or downstream expands, pipes, redirects or chains. Text that a
shell would treat as syntax (unquoted ``;``, ``|``, ``$``, globs...) is refused
rather than passed through, so what the agent wrote and what runs cannot differ.

The policy is a narrowing layer on top of the kernel sandbox, which is the real
security boundary. Deciding which program may run is exact; deciding what an
allowed program may do with its arguments is best-effort: the argument rules
block the known ways to make an allowed tool run another program or write
outside the workspace, but they cannot know every option of every tool. For
example git reads ``.git/config`` and hooks from the workspace, which the agent
can write, so git can always run code inside the sandbox.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import InitVar, dataclass
from typing import Final, final

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from bastion.safety.errors import BastionError, InvalidRequest, NotFound, PolicyDenied

FIXED_PATH: Final = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
MAX_COMMAND_CHARS: Final = 16_384
MAX_ARGS: Final = 1_024
MAX_SCRIPT_CHARS: Final = 65_536

_FIXED_DIRS: Final = frozenset(FIXED_PATH.split(":"))

# Characters that are shell syntax wherever they appear unquoted.
_SHELL_SYNTAX: Final = frozenset(";|&<>()$`*?[]{}")
# Shell syntax only at the start of a word: tilde expansion and comments (POSIX 2.6.1, 2.3).
_WORD_START_SYNTAX: Final = frozenset("~#")
# Inside double quotes a shell still expands these (POSIX 2.2.3).
_DQUOTE_EXPANDS: Final = frozenset("$`")
# Inside double quotes a backslash escapes only these; before anything else it is literal.
_DQUOTE_ESCAPABLE: Final = frozenset('$`"\\')
_WORD_SEPARATORS: Final = frozenset(" \t")

# Cc: C0, DEL and C1 controls (NUL, newline, ESC...); Cf: invisible format characters
# (zero-width space, bidi overrides) that hide or reorder text; Cs: lone surrogates,
# which cannot be encoded for exec; Zl/Zp: Unicode line breaks, which forge log lines.
_FORBIDDEN_CATEGORIES: Final = {
    "Cc": "control",
    "Cf": "invisible format",
    "Cs": "surrogate",
    "Zl": "line separator",
    "Zp": "paragraph separator",
}

_MAX_SHOWN_CHARS: Final = 60
# A denied name with a version after it is another build of the same program: python3.11, perl5.36.0,
# pip-3, perl5.36-x86_64-linux-gnu (a platform after the version).
# The platform tail is a machine's name (x86_64-linux-gnu...): python3-config is not a build of python.
_PLATFORM: Final = r"(?:x86_64|i[3-6]86|aarch64|arm|riscv|ppc|s390|mips)"
_VERSION_SUFFIX: Final = re.compile(rf"[.-]?[0-9][0-9.]*(?:-{_PLATFORM}[A-Za-z0-9_.+-]*)?")
# A shell script runs its own fixed lines (gunzip, which, zcat are ones): a denied shell still lets them run.
_SHELLS: Final = frozenset({"sh", "dash", "bash"})
_MAX_KNOWN_PROGRAMS: Final = 1024  # interpreters remembered per policy (a fixed PATH holds a few thousand files)
_SCRIPT_HEAD_BYTES: Final = 256  # the kernel reads a #! line from the first 256 bytes (BINPRM_BUF_SIZE)
_MAX_LINK_HOPS: Final = 40  # the kernel's own limit on symlinks in one lookup (path_resolution(7))
# File times tick with the kernel's coarse clock (a few ms): a folder changed this recently may change
# again without its mtime moving, so its scan is not kept (git's "racy clean" entries, racy-git.txt).
_RACY_NS: Final = 1_000_000_000


def _forbidden_char(text: str) -> str | None:
    """Return a one-line description of the first forbidden character in `text`, or None."""
    for char in text:
        if char == "\t" or (" " <= char <= "~"):
            continue
        kind = _FORBIDDEN_CATEGORIES.get(unicodedata.category(char))
        if kind is not None:
            return f"{kind} character U+{ord(char):04X} is not allowed in a command: remove it"
    return None


def _shown(token: str) -> str:
    """Quote a token for a message, cut to a readable length."""
    if len(token) > _MAX_SHOWN_CHARS:
        token = token[:_MAX_SHOWN_CHARS] + "..."
    return repr(token)


def _syntax_error(char: str) -> InvalidRequest:
    return InvalidRequest(f"unquoted {char!r} is shell syntax, and no shell runs here: quote it to pass it literally")


def parse_command(text: str) -> tuple[str, ...]:
    """Split a command line into argv the way POSIX sh quoting would, without running a shell.

    Single quotes make everything literal; double quotes make everything literal
    except ``$`` and backtick, which are refused; a backslash outside quotes makes
    the next character literal; adjacent parts join into one word (``r''m`` is ``rm``).

    Args:
        text: the command line as the agent wrote it.

    Returns:
        The argv, at least one word.

    Raises:
        InvalidRequest: the text is empty, too long, has too many words, contains a
            control or invisible character, has unbalanced quotes, or uses unquoted
            shell syntax.
    """
    # Not shlex: shlex drops the quotes, so afterwards nobody can tell whether a ';'
    # was quoted (plain text) or unquoted (a shell would have chained a command).
    if len(text) > MAX_COMMAND_CHARS:
        raise InvalidRequest(f"command is {len(text)} characters, over the limit of {MAX_COMMAND_CHARS}: shorten it")
    problem = _forbidden_char(text)
    if problem is not None:
        raise InvalidRequest(problem)

    words: list[str] = []
    current: list[str] = []
    in_word = False
    i = 0
    n = len(text)
    while i < n:
        char = text[i]
        if char in _WORD_SEPARATORS:
            if in_word:
                words.append("".join(current))
                if len(words) > MAX_ARGS:
                    raise InvalidRequest(f"command has more than {MAX_ARGS} arguments: split the work")
                current = []
                in_word = False
            i += 1
        elif char == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise InvalidRequest("unbalanced single quote: close it")
            current.append(text[i + 1 : end])
            in_word = True
            i = end + 1
        elif char == '"':
            i = _read_double_quoted(text, i + 1, current)
            in_word = True
        elif char == "\\":
            if i + 1 >= n:
                raise InvalidRequest("trailing backslash escapes nothing: remove it or quote it")
            current.append(text[i + 1])
            in_word = True
            i += 2
        elif char in _SHELL_SYNTAX or (not in_word and char in _WORD_START_SYNTAX):
            raise _syntax_error(char)
        else:
            current.append(char)
            in_word = True
            i += 1
    if in_word:
        words.append("".join(current))
    if not words:
        raise InvalidRequest("command is empty: give a program name")
    if len(words) > MAX_ARGS:
        raise InvalidRequest(f"command has more than {MAX_ARGS} arguments: split the work")
    return tuple(words)


def _read_double_quoted(text: str, start: int, out: list[str]) -> int:
    """Append the body of a double-quoted part that begins at `start`; return the index after the closing quote."""
    i = start
    n = len(text)
    while i < n:
        char = text[i]
        if char == '"':
            return i + 1
        if char == "\\" and i + 1 < n and text[i + 1] in _DQUOTE_ESCAPABLE:
            out.append(text[i + 1])
            i += 2
        elif char in _DQUOTE_EXPANDS:
            raise InvalidRequest(
                f"{char!r} inside double quotes would be expanded by a shell, and no shell runs here: "
                "use single quotes to pass it literally"
            )
        else:
            out.append(char)
            i += 1
    raise InvalidRequest("unbalanced double quote: close it")


def _check_command_name(name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"{name!r} is not a command name: use the bare name, e.g. 'git'")
    return name


class ArgumentRule(BaseModel):
    """Argument restrictions for one command.

    Attributes:
        command: the command name the rule applies to, e.g. ``git``.
        when: positional (non-option) words that must all be present for the rule to apply, e.g. ``("push",)``.
        deny_args: denied arguments; each entry lists alternatives separated by ``|``, e.g. ``-f|--force``.
            ``--long`` also matches ``--long=value`` and unambiguous abbreviations (``--outp``);
            ``-x`` matches any single-dash cluster containing ``x`` (``-uf``, ``-xvalue``);
            ``-word`` matches ``-word`` and ``-word=value``; a plain word matches itself.
        subcommands: if set, the first non-option argument, when present, must be one of these, and
            only options in `flags_before_subcommand` or written ``--option=value`` may come before it.
        flags_before_subcommand: options that take no value and may come before the subcommand, e.g.
            ``--no-pager``. Any other option there could take the next word as its value (``git -C status
            clean``), so that the subcommand check would judge the value instead of the subcommand.
        bundled_first_arg: the first argument is an option cluster even without a leading ``-``,
            as in tar's traditional ``tar xIf``; single-letter denials then match it too.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    command: str
    when: tuple[str, ...] = ()
    deny_args: tuple[str, ...] = ()
    subcommands: tuple[str, ...] | None = None
    flags_before_subcommand: tuple[str, ...] = ()
    bundled_first_arg: bool = False

    @field_validator("command")
    @classmethod
    def _command_is_a_name(cls, value: str) -> str:
        return _check_command_name(value)

    @field_validator("deny_args")
    @classmethod
    def _alternatives_are_arguments(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            for alternative in entry.split("|"):
                # An empty or bare-dash alternative would match nothing useful or everything.
                if alternative in ("", "-", "--") or alternative != alternative.strip():
                    raise ValueError(f"deny_args entry {entry!r} has an empty or blank alternative: fix the list")
        return value

    @field_validator("flags_before_subcommand")
    @classmethod
    def _flags_are_options(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for flag in value:
            if not _is_option(flag) or flag == "--" or "=" in flag or flag != flag.strip():
                raise ValueError(f"flags_before_subcommand entry {flag!r} is not an option such as '--no-pager'")
        return value

    @model_validator(mode="after")
    def _flags_need_subcommands(self) -> ArgumentRule:
        if self.flags_before_subcommand and self.subcommands is None:
            raise ValueError("flags_before_subcommand applies only with subcommands: add subcommands or remove it")
        return self


class CommandPolicyConfig(BaseModel):
    """Which commands a workspace may run. Default deny: an empty policy allows nothing.

    Attributes:
        allow: command names that may run; ``*`` means every command on the fixed PATH.
        deny: command names that may never run; deny wins over allow and over ``*``.
        rules: argument rules for allowed commands.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    rules: tuple[ArgumentRule, ...] = ()

    @field_validator("allow")
    @classmethod
    def _allow_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if name != "*":
                _check_command_name(name)
        return value

    @field_validator("deny")
    @classmethod
    def _deny_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if name == "*":
                raise ValueError("'*' in deny matches no command: an empty allow list already denies everything")
            _check_command_name(name)
        return value


_PROOF_TOKEN: Final = object()


@final
@dataclass(frozen=True)
class ApprovedCommand:
    """Proof that `CommandPolicy` approved this argv; only the policy creates one.

    Attributes:
        argv: the arguments, argv[0] as the agent wrote it.
        executable: absolute path of the program, found on `FIXED_PATH`.
        rule: the policy rule that allowed it, e.g. ``allow: git``.
    """

    argv: tuple[str, ...]
    executable: str
    rule: str
    # An InitVar, so dataclasses.replace() cannot copy the token into a forged instance.
    _token: InitVar[object] = None

    def __post_init__(self, _token: object) -> None:
        if _token is not _PROOF_TOKEN:
            raise TypeError("ApprovedCommand is created only by CommandPolicy.check: call the policy")


@dataclass(frozen=True)
class Decision:
    """What the policy would do with a command, for explaining; running nothing.

    Attributes:
        allowed: whether `CommandPolicy.check` would approve it.
        rule: the rule that decided, e.g. ``deny: rm`` or ``parse: ...``.
        reason: one line for the client.
        argv: the parsed argv, empty when parsing failed.
        executable: the program that would run, when one was found.
    """

    allowed: bool
    rule: str
    reason: str
    argv: tuple[str, ...]
    executable: str | None


def _option_matches(alternative: str, token: str) -> bool:
    """Whether `token` is the option (or word) `alternative`, erring toward a match."""
    if alternative.startswith("--"):
        if token == alternative or token.startswith(alternative + "="):
            return True
        # git's parse-options and GNU getopt_long accept unambiguous abbreviations: --outp is --output.
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0]
            return bool(name) and alternative[2:].startswith(name)
        return False
    if len(alternative) == 2 and alternative[0] == "-":
        # A short option may sit in a cluster (-uf) or carry an attached value (-ccore.pager=x);
        # any single-dash token holding the letter matches, on purpose.
        return token.startswith("-") and not token.startswith("--") and alternative[1] in token[1:]
    if alternative.startswith("-"):
        # find/zip style long options with one dash do not abbreviate or cluster.
        return token == alternative or token.startswith(alternative + "=")
    return token == alternative


def _is_option(word: str) -> bool:
    # A lone "-" conventionally means stdin: an operand, not an option.
    return word.startswith("-") and word != "-"


@dataclass(frozen=True)
class _CompiledRule:
    when: frozenset[str]
    deny: tuple[tuple[str, tuple[str, ...]], ...]
    subcommands: frozenset[str] | None
    flags_before_subcommand: frozenset[str]
    bundled_first_arg: bool


class _Refusal(Exception):
    """Internal: carries the rule text alongside the client-facing error."""

    def __init__(self, error: BastionError, rule: str, executable: str | None = None) -> None:
        super().__init__(error.reason)
        self.error = error
        self.rule = rule
        self.executable = executable


class CommandPolicy:
    """Decide whether a command may run, by name, resolved executable and argument rules.

    Exact about which program runs; best-effort about what that program does with its
    arguments (see the module docstring). The kernel sandbox remains the boundary.
    """

    def __init__(self, config: CommandPolicyConfig) -> None:
        """Compile `config` once.

        Args:
            config: the validated policy; an empty one denies every command.
        """
        self._allow = frozenset(config.allow)
        self._deny = frozenset(config.deny)
        self._denied_files = _DeniedFiles(config.deny)
        # A program's #! interpreter by (st_dev, st_ino, st_ctime_ns): reading its head cost ~20 us a command,
        # and any change to the file (content, mode, links) moves its ctime.
        self._interpreters: dict[tuple[int, int, int], str | None] = {}
        rules: dict[str, list[_CompiledRule]] = {}
        for rule in config.rules:
            compiled = _CompiledRule(
                when=frozenset(rule.when),
                deny=tuple((entry, tuple(entry.split("|"))) for entry in rule.deny_args),
                subcommands=None if rule.subcommands is None else frozenset(rule.subcommands),
                flags_before_subcommand=frozenset(rule.flags_before_subcommand),
                bundled_first_arg=rule.bundled_first_arg,
            )
            rules.setdefault(rule.command, []).append(compiled)
        self._rules = {name: tuple(compiled_rules) for name, compiled_rules in rules.items()}

    def check(self, command: str) -> ApprovedCommand:
        """Parse a command line and approve it, or raise.

        Args:
            command: the command line as the agent wrote it.

        Returns:
            Proof of approval, holding the argv and the executable to run.

        Raises:
            InvalidRequest: the command line cannot be parsed safely.
            PolicyDenied: a rule refuses the command or one of its arguments.
            NotFound: the command is allowed but is not on the fixed PATH.
        """
        argv = parse_command(command)
        return self._approve(argv)

    def check_argv(self, argv: Sequence[str]) -> ApprovedCommand:
        """Approve an already-split argv, or raise.

        Args:
            argv: the program name and its arguments; shell syntax in them is plain text.

        Returns:
            Proof of approval, holding the argv and the executable to run.

        Raises:
            InvalidRequest: argv is empty, too large, or has control or invisible characters.
            PolicyDenied: a rule refuses the command or one of its arguments.
            NotFound: the command is allowed but is not on the fixed PATH.
        """
        return self._approve(_validate_argv(argv))

    def check_script(self, script: str) -> ApprovedCommand:
        """Approve a shell script to run as ``sh -c SCRIPT``, or raise.

        For sandboxes, where the kernel is the boundary and a shell is the point: the
        policy must allow ``sh`` (or ``*``). Only NUL is refused in the script, since
        exec cannot carry it; newlines and every shell feature are the user's to use.

        Raises:
            InvalidRequest: the script is empty, too long, or contains NUL.
            PolicyDenied: the policy does not allow ``sh``.
        """
        if not script.strip():
            raise InvalidRequest("the command is empty: give a command to run")
        if len(script) > MAX_SCRIPT_CHARS:
            raise InvalidRequest(f"the command is longer than {MAX_SCRIPT_CHARS} characters: write a script file")
        if "\0" in script:
            raise InvalidRequest("the command contains NUL, which no program can receive: remove it")
        return self._approve(("sh", "-c", script))

    def explain_script(self, script: str) -> Decision:
        """Say what `check_script` would decide; runs nothing and never raises."""
        try:
            approved = self.check_script(script)
        except BastionError as error:
            return Decision(allowed=False, rule=error.detail or "script", reason=error.reason, argv=(), executable=None)
        reason = "any shell command runs here: the kernel sandbox is the boundary"
        return Decision(
            allowed=True, rule=approved.rule, reason=reason, argv=approved.argv, executable=approved.executable
        )

    def explain(self, command: str) -> Decision:
        """Say what `check` would decide and which rule decided; runs nothing and never raises.

        Args:
            command: the command line as the agent wrote it.

        Returns:
            The decision, with the rule text and a one-line reason.
        """
        try:
            argv = parse_command(command)
        except InvalidRequest as error:
            return Decision(allowed=False, rule=f"parse: {error.reason}", reason=error.reason, argv=(), executable=None)
        try:
            executable, rule = self._decide(argv)
        except _Refusal as refusal:
            return Decision(
                allowed=False, rule=refusal.rule, reason=refusal.error.reason, argv=argv, executable=refusal.executable
            )
        return Decision(allowed=True, rule=rule, reason="allowed by policy", argv=argv, executable=executable)

    def _approve(self, argv: tuple[str, ...]) -> ApprovedCommand:
        try:
            executable, rule = self._decide(argv)
        except _Refusal as refusal:
            refusal.error.detail = refusal.rule
            raise refusal.error from None
        return ApprovedCommand(argv, executable, rule, _PROOF_TOKEN)

    def _decide(self, argv: tuple[str, ...]) -> tuple[str, str]:
        """Return (executable, rule that allowed it), or raise _Refusal."""
        name, search_path = _resolve_name(argv[0])
        if name in self._deny:
            raise _Refusal(PolicyDenied(f"{_shown(name)} is denied by policy: use another command"), f"deny: {name}")
        denied = _versioned(name, self._deny)
        if denied is not None:
            raise _Refusal(
                PolicyDenied(
                    f"{_shown(name)} is a version of {denied!r}, which is denied by policy: use another command"
                ),
                f"deny: {denied} (version {name})",
            )
        if name in self._allow:
            allow_rule = f"allow: {name}"
        elif "*" in self._allow:
            allow_rule = f"allow: * ({name})"
        else:
            raise _Refusal(
                PolicyDenied(f"{_shown(name)} is not in the allow list: use an allowed command"),
                f"default deny: {_shown(name)} is not in the allow list",
            )
        # Rules before the lookup, so a refusal does not depend on what is installed.
        for rule in self._rules.get(name, ()):
            _apply_rule(name, rule, argv)
        executable = shutil.which(name, path=search_path)
        if executable is None:
            raise _Refusal(
                NotFound(f"{_shown(name)} is allowed but was not found on the fixed PATH: install it or use another"),
                f"not found: {_shown(name)} is not on {search_path}",
            )
        executable = os.path.abspath(executable)
        self._refuse_other_names(name, executable)
        return executable, allow_rule

    def _refuse_other_names(self, name: str, executable: str) -> None:
        """Refuse a program that a denied name also leads to, by another name.

        An alias symlink (awk -> mawk, sh -> dash), the versioned file behind it (python3.11) or a
        hard link (perl5.36.0 is perl) must not dodge a deny on the program. A point-in-time check,
        like the lookup itself: the file could be replaced between this and the exec.
        """
        real_name = os.path.basename(os.path.realpath(executable))
        denied = real_name if real_name in self._deny else _versioned(real_name, self._deny)
        if denied is not None:
            raise _Refusal(
                PolicyDenied(f"{_shown(name)} is {real_name!r}, which is denied by policy: use another command"),
                f"deny: {denied} (via {name})",
                executable,
            )
        try:
            info = os.stat(executable)
        except OSError:
            raise _Refusal(
                NotFound(f"{_shown(name)} vanished while it was checked: try again"),
                f"not found: {_shown(name)} vanished from {executable}",
                executable,
            ) from None
        denied = self._denied_files.name_of(info)
        if denied is not None:
            raise _Refusal(
                PolicyDenied(f"{_shown(name)} is the same program as the denied {denied!r}: use another command"),
                f"deny: {denied} (same file as {name})",
                executable,
            )
        interpreter = self._interpreter(executable, info)
        shell = interpreter is not None and os.path.basename(interpreter) in _SHELLS
        denied = None if interpreter is None or shell else self._denied_program(interpreter)
        if denied is not None:
            raise _Refusal(
                PolicyDenied(f"{_shown(name)} is a script run by the denied {denied!r}: use another command"),
                f"deny: {denied} (the interpreter of {name})",
                executable,
            )

    def _interpreter(self, executable: str, info: os.stat_result) -> str | None:
        key = (info.st_dev, info.st_ino, info.st_ctime_ns)
        if key not in self._interpreters:
            if len(self._interpreters) >= _MAX_KNOWN_PROGRAMS:
                self._interpreters.clear()
            self._interpreters[key] = _script_interpreter(executable)
        return self._interpreters[key]

    def _denied_program(self, path: str) -> str | None:
        """The denied name that the program at `path` (a script's interpreter) is, by name, version or file."""
        for candidate in (os.path.basename(path), os.path.basename(os.path.realpath(path))):
            denied = candidate if candidate in self._deny else _versioned(candidate, self._deny)
            if denied is not None:
                return denied
        try:
            return self._denied_files.name_of(os.stat(path))
        except OSError:
            return None


def _script_interpreter(executable: str) -> str | None:
    """The program a `#!` script runs (through `env`, the program env runs: pdb3 is `#!/usr/bin/env python3`),
    or None for a binary or an unreadable file. A denied interpreter must not run by way of an allowed name."""
    try:
        with open(executable, "rb") as file:
            head = file.read(_SCRIPT_HEAD_BYTES)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").split()
    if not words:
        return None
    if os.path.basename(words[0]) != "env":
        return words[0]
    program = next((word for word in words[1:] if not word.startswith("-") and "=" not in word), None)
    if program is None:
        return None
    return program if "/" in program else (shutil.which(program, path=FIXED_PATH) or program)


@functools.lru_cache(maxsize=64)
def _longest(denied: frozenset[str]) -> int:
    # Once per deny list (a frozenset keeps its hash): measuring ~80 names took 15 us at every check.
    return max((len(d) for d in denied), default=0)


def _versioned(name: str, denied: frozenset[str]) -> str | None:
    """The denied name that `name` is a version of (python3.11 of python3, perl5.36.0 of perl), or None."""
    longest = _longest(denied)
    # Longest prefix first, so python3.11 names python3 rather than python when both are denied.
    for cut in range(min(len(name) - 1, longest), 0, -1):
        if name[:cut] in denied and _VERSION_SUFFIX.fullmatch(name, cut):
            return name[:cut]
    return None


_FolderKey = tuple[tuple[str, int, int], ...]


def _folder_key(folders: tuple[str, ...]) -> _FolderKey:
    """(path, inode, mtime) of each folder: an entry added, removed or renamed in one changes it."""
    key: list[tuple[str, int, int]] = []
    for folder in folders:
        try:
            info = os.stat(folder)
        except OSError:
            key.append((folder, -1, -1))
        else:
            key.append((folder, info.st_ino, info.st_mtime_ns))
    return tuple(key)


def _settled(key: _FolderKey) -> bool:
    """Whether no folder of `key` changed so recently that a change after it could keep its mtime.
    A time in the future (a restored archive's, a clock set back) is not recent: it would rescan at every
    check until the clock caught up."""
    now = time.time_ns()
    return all(mtime < now - _RACY_NS or mtime > now + _RACY_NS for _, _, mtime in key)


@dataclass(frozen=True)
class _DeniedSnapshot:
    folders: tuple[str, ...]
    key: _FolderKey
    files: dict[tuple[int, int], str]


class _DeniedFiles:
    """The files that denied names lead to on the fixed PATH, by (st_dev, st_ino).

    Scanning costs about a millisecond for the demo's deny list, so it is kept and scanned again
    only when a folder it went through (the fixed PATH's, and those its symlinks led into, such
    as /etc/alternatives) changed; checking that costs a few stat calls.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        # In the config's order: a file two denied names lead to (vi, vim) is reported as the first one's.
        self._names = tuple(dict.fromkeys(names))
        folders = tuple(sorted(_FIXED_DIRS))
        self._snapshot = _DeniedSnapshot(folders, (), {})

    def name_of(self, info: os.stat_result) -> str | None:
        """The denied name whose file `info` is, or None."""
        if not self._names:
            return None
        snapshot = self._snapshot
        key = _folder_key(snapshot.folders)
        if key != snapshot.key:
            # The key is taken before the scan: a change during it shows at the next check.
            folders, files = self._scan()
            kept = key if folders == snapshot.folders and _settled(key) else ()
            snapshot = _DeniedSnapshot(folders, kept, files)
            self._snapshot = snapshot
        return snapshot.files.get((info.st_dev, info.st_ino))

    def _scan(self) -> tuple[tuple[str, ...], dict[tuple[int, int], str]]:
        folders = set(_FIXED_DIRS)
        files: dict[tuple[int, int], str] = {}
        for directory in FIXED_PATH.split(":"):
            for name in self._names:
                path = os.path.join(directory, name)
                folders.update(_link_folders(path))
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                files.setdefault((info.st_dev, info.st_ino), name)
        return tuple(sorted(folders)), files


def _link_folders(path: str) -> list[str]:
    """The folders that the symlinks from `path` lead through (/etc/alternatives for /usr/bin/editor)."""
    found: list[str] = []
    for _ in range(_MAX_LINK_HOPS):
        try:
            target = os.readlink(path)
        except OSError:
            break
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))
        found.append(os.path.dirname(path))
    return found


def _apply_rule(name: str, rule: _CompiledRule, argv: tuple[str, ...]) -> None:
    args = argv[1:]
    positional = [token for token in args if not _is_option(token)]
    if not rule.when <= set(positional):
        return
    tokens = list(args)
    if rule.bundled_first_arg and tokens and not tokens[0].startswith("-"):
        tokens[0] = "-" + tokens[0]
    for entry, alternatives in rule.deny:
        for index, token in enumerate(tokens):
            for alternative in alternatives:
                if _option_matches(alternative, token):
                    shown = args[index]
                    raise _Refusal(
                        PolicyDenied(f"{name} may not run with {_shown(shown)}: the policy denies {entry!r}"),
                        f"rule {name}: deny {entry!r} (matched {_shown(shown)})",
                    )
    if rule.subcommands is not None:
        _check_subcommand(name, rule.subcommands, rule.flags_before_subcommand, args)


def _check_subcommand(name: str, subcommands: frozenset[str], flags: frozenset[str], args: tuple[str, ...]) -> None:
    """The first non-option word must be an allowed subcommand, and only known flags may come before it."""
    for token in args:
        if not _is_option(token):
            if token not in subcommands:
                raise _Refusal(
                    PolicyDenied(
                        f"{name} subcommand {_shown(token)} is not allowed: use one of the allowed subcommands"
                    ),
                    f"rule {name}: subcommand {_shown(token)} is not allowed",
                )
            return
        # An option with a separate value (git --namespace status clean) would make its value
        # pass for the subcommand; only an attached value leaves the next word alone.
        if token not in flags and not _is_long_with_value(token):
            raise _Refusal(
                PolicyDenied(
                    f"{name} may not run with {_shown(token)} before its subcommand: put only the options "
                    "the policy lists, or --option=value, before it"
                ),
                f"rule {name}: option {_shown(token)} before the subcommand is not allowed",
            )


def _is_long_with_value(token: str) -> bool:
    option, equals, _ = token.partition("=")
    return option.startswith("--") and len(option) > 2 and bool(equals)


def _resolve_name(argv0: str) -> tuple[str, str]:
    """Return (command name, search path) for argv[0]; a path must name a fixed-PATH directory."""
    if not argv0:
        raise _Refusal(InvalidRequest("command name is empty: give a program name"), "parse: empty command name")
    if "/" not in argv0:
        return argv0, FIXED_PATH
    # normpath, not realpath: the decision is about the name asked for; a symlinked
    # directory must not turn an outside path into an inside one.
    normal = os.path.normpath(argv0)
    directory, name = os.path.split(normal)
    if directory not in _FIXED_DIRS or not name or name in (".", ".."):
        raise _Refusal(
            PolicyDenied(f"{_shown(argv0)} is not on the fixed PATH: only commands on the fixed PATH may run"),
            f"fixed path: {_shown(argv0)} is not in {FIXED_PATH}",
        )
    # Run the file asked for, not a same-named one earlier on the PATH.
    return name, directory


def _validate_argv(argv: Sequence[str]) -> tuple[str, ...]:
    if isinstance(argv, str):
        raise InvalidRequest("argv must be a list of strings, not one string: split it or use check()")
    words = tuple(argv)
    if not words:
        raise InvalidRequest("argv is empty: give a program name")
    if len(words) > MAX_ARGS:
        raise InvalidRequest(f"command has more than {MAX_ARGS} arguments: split the work")
    total = 0
    for word in words:
        if not isinstance(word, str):
            raise InvalidRequest("every argv item must be a string: convert it")
        total += len(word) + 1
        problem = _forbidden_char(word)
        if problem is not None:
            raise InvalidRequest(problem)
    if total > MAX_COMMAND_CHARS:
        raise InvalidRequest(f"command is {total} characters, over the limit of {MAX_COMMAND_CHARS}: shorten it")
    return words


# The demo policy: data, reviewed like code. Conservative allow-list; the deny list names
# shells, interpreters, exec wrappers, network and privilege tools, and also catches alias
# symlinks (awk -> mawk). Argument rules block options that run another program or write
# files the tool was not asked to write.
# fmt: off
DEMO_POLICY: Final = CommandPolicyConfig(
    allow=(
        # read and inspect
        "ls", "cat", "head", "tail", "wc", "grep", "find", "stat", "file", "pwd", "realpath",
        "basename", "dirname", "date", "printenv", "sha256sum", "md5sum", "diff",
        # text
        "echo", "printf", "sort", "uniq", "cut", "tr",
        # files in the workspace
        "mkdir", "touch", "cp", "mv", "tar",
        # misc
        "true", "false", "sleep", "git",
    ),
    deny=(
        # delete, privilege, permissions, devices
        "rm", "sudo", "su", "doas", "pkexec", "chmod", "chown", "dd", "mount", "iptables",
        # shells (busybox is one; denying it fails closed where coreutils are busybox links)
        "sh", "bash", "dash", "zsh", "ksh", "fish", "csh", "tcsh", "busybox",
        # interpreters and programmable tools (sed has 'e' and 'w' commands)
        "python", "python3", "pydoc", "pydoc3", "perl", "node", "ruby", "php", "lua", "tclsh", "wish", "expect",
        "awk", "gawk", "mawk", "nawk", "sed",
        # editors and pagers, which run a shell on request (vim's :!, less's !)
        "vi", "vim", "ex", "ed", "editor", "less", "more", "pager", "man", "vimtutor",
        # wrappers that run another command
        "env", "xargs", "nice", "nohup", "timeout", "stdbuf", "setsid", "chroot", "unshare", "nsenter",
        "script", "watch", "flock", "setpriv", "prlimit", "taskset", "chrt", "ionice", "strace", "gdb", "git-shell",
        # network and package managers
        "curl", "wget", "nc", "ncat", "socat", "ssh", "scp", "rsync", "pip", "pip3",
        # tools with plugin or exec options
        "pytest", "zip",
    ),
    rules=(
        # git reads .git/config and hooks from the workspace, so it can run code in the
        # sandbox whatever this says; these rules stop the command line from adding more.
        ArgumentRule(
            command="git",
            subcommands=(
                "status", "log", "diff", "show", "add", "commit", "branch", "checkout", "switch",
                "restore", "init", "rev-parse", "ls-files", "grep", "blame", "tag", "stash", "mv",
            ),
            # git's global options that take no value; -C, --namespace, --git-dir DIR... take the next
            # word, which would then pass for the subcommand (the =value forms are accepted).
            flags_before_subcommand=(
                "--no-pager", "-P", "-p", "--paginate", "--bare", "--no-replace-objects", "--literal-pathspecs",
                "--glob-pathspecs", "--noglob-pathspecs", "--icase-pathspecs", "--no-optional-locks", "--no-advice",
                "--version",
            ),
            deny_args=(
                "-c|--config-env",  # sets any config key: core.pager, core.sshCommand...
                "--exec",  # archive/push/fetch-pack: the remote helper to run; rebase: a command per commit
                "--help",  # git log --help is git help log: it runs man
                "--exec-path",  # runs git-* helpers from another directory
                "--upload-pack",
                "--receive-pack",
                "--output",  # log/diff write to any path
                "--open-files-in-pager",
                "--ext-diff",  # runs diff.external
            ),
        ),
        ArgumentRule(command="git", when=("grep",), deny_args=("-O",)),  # -O is --open-files-in-pager
        ArgumentRule(command="git", when=("clone",), deny_args=("-u",)),  # -u is --upload-pack
        ArgumentRule(command="git", when=("rebase",), deny_args=("-x",)),  # -x is --exec
        ArgumentRule(
            command="find",
            deny_args=("-exec", "-execdir", "-ok", "-okdir", "-delete", "-fprint", "-fprint0", "-fprintf", "-fls"),
        ),
        ArgumentRule(
            command="tar",
            bundled_first_arg=True,  # tar xIf PROG: old-style options need no dash
            deny_args=(
                "--to-command",
                "--checkpoint-action",
                "-I|--use-compress-program",
                "--rsh-command",
                "--rmt-command",
                "-F|--info-script|--new-volume-script",
            ),
        ),
        ArgumentRule(command="sort", deny_args=("--compress-program",)),  # runs PROG on temp files
    ),
)
# fmt: on
