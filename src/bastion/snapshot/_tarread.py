"""Reading a snapshot's tar stream one bounded header at a time. THIS MODULE IS A SECURITY BOUNDARY.

`tarfile` reads a PAX extended header, a GNU long name and a GNU sparse map into memory whole
before any caller can check them, and follows extended headers by recursion: a tampered
archive's 400 MB PAX header took the server to 1.3 GB of memory. `TarReader` reads the subset
`bastion.snapshot._archive` writes, and checks each size before it reads:

- ustar headers (POSIX ``ustar\\0 00`` or GNU ``ustar  \\0`` magic), checksum verified; no v7.
- At most one ``x`` extended header (`MAX_PAX_HEADER_BYTES`), one GNU long name ``L`` and one
  long link ``K`` (`MAX_LONG_NAME_BYTES`) before each member. A global ``g`` header is refused.
- PAX records are parsed strictly (``LEN KEY=VALUE\\n``, LEN exact); values must be UTF-8.
  ``path``, ``linkpath``, ``mtime``, ``size`` and the GNU sparse 1.0 keys are used; other
  keywords are ignored (POSIX.1-2001 lets a reader ignore keywords it does not know).
- GNU sparse 1.0 members (``GNU.sparse.major=1``, ``minor=0``): the map at the start of the
  content is read a block at a time, at most `MAX_SPARSE_SEGMENTS` entries per file and
  `MAX_SPARSE_SEGMENTS_TOTAL` per archive; segments must be in order, inside the file, and
  add up to the content that follows. Older GNU sparse forms are refused.

It judges the format only: member names, types, sizes against the snapshot bounds, and where
anything is written are `bastion.snapshot._extract`'s. Memory is bounded by the largest
header plus one content chunk, whatever the archive holds.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Protocol

from bastion.safety.errors import PolicyDenied, ResourceLimit

BLOCK: Final = tarfile.BLOCKSIZE
MAX_PAX_HEADER_BYTES: Final = 32 * 1024
MAX_LONG_NAME_BYTES: Final = 4097  # a 4096-byte path and its NUL
MAX_SPARSE_SEGMENTS: Final = 16_384
MAX_SPARSE_SEGMENTS_TOTAL: Final = 262_144
# Per sparse segment the map holds two decimal numbers of at most 20 digits, each with its newline.
SPARSE_MAP_BYTES_PER_SEGMENT: Final = 42

_ZERO_BLOCK: Final = bytes(BLOCK)
_POSIX_MAGIC: Final = b"ustar\x0000"
_GNU_MAGIC: Final = b"ustar  \x00"
_MAX_DIGITS: Final = 20
_MAX_FILE_OFFSET: Final = 2**63 - 1  # off_t
_NS_PER_S: Final = 1_000_000_000
_MTIME_RE: Final = re.compile(r"-?[0-9]{1,20}(\.[0-9]{1,20})?")
_SPARSE_KEYS_OLD: Final = frozenset(
    {"GNU.sparse.size", "GNU.sparse.numblocks", "GNU.sparse.offset", "GNU.sparse.numbytes", "GNU.sparse.map"}
)
_UTF8: Final = "ISO-IR 10646 2000 UTF-8"


class CorruptArchive(Exception):
    """The stream is not a well-formed archive of the kind this server writes (the reason says where)."""


class Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Member:
    """One archive member, its extended headers applied.

    Attributes:
        name: the member's path as stored (checked by the extractor, not here).
        type: the ustar type flag (``0`` file, ``5`` folder, ``2`` symlink, ...).
        mode: permission bits as stored.
        mtime_ns: nanoseconds, as stored (a PAX mtime's decimals, never through a float).
        size: bytes of content in the stream (a sparse file's map and data).
        linkname: a symlink's target.
        realsize: the file's size once extracted (``size`` unless sparse).
        sparse: a GNU sparse 1.0 member: read its map with `TarReader.sparse_map` first.
    """

    name: str
    type: bytes
    mode: int
    mtime_ns: int
    size: int
    linkname: str
    realsize: int
    sparse: bool


@dataclass(frozen=True, slots=True)
class _Header:
    name: str
    type: bytes
    mode: int
    mtime: int
    size: int
    linkname: str


class TarReader:
    """Members of a tar stream, in order; each member's content is read (or skipped) before the next."""

    def __init__(self, stream: Readable) -> None:
        self._stream = stream
        self._left = 0  # content bytes of the current member not yet read
        self._padding = 0
        self._segments = 0

    def next(self) -> Member | None:
        """The next member, or None at the end of the archive.

        Raises:
            CorruptArchive: a malformed header or extended header.
            ResourceLimit: a header over its bound.
            PolicyDenied: a global header or an older GNU sparse form.
        """
        self._skip(self._left + self._padding)
        self._left = self._padding = 0
        pax: dict[str, str] | None = None
        long_name: str | None = None
        long_link: str | None = None
        while True:
            block = self._read_block(allow_eof=True)
            if block is None or block == _ZERO_BLOCK:
                return None
            header = _parse_header(block)
            if header.type == b"x":
                if pax is not None:
                    raise CorruptArchive("two extended headers for one member")
                pax = _parse_pax(self._read_extra(header.size, MAX_PAX_HEADER_BYTES, "an extended (PAX) header"))
            elif header.type in (b"L", b"K"):
                if (long_name if header.type == b"L" else long_link) is not None:
                    raise CorruptArchive("two GNU long names for one member")
                text = _text(self._read_extra(header.size, MAX_LONG_NAME_BYTES, "a GNU long name").rstrip(b"\x00"))
                if header.type == b"L":
                    long_name = text
                else:
                    long_link = text
            elif header.type == b"g":
                raise PolicyDenied("the snapshot has a global extended header, which bastion never writes: refused")
            else:
                return self._member(header, pax or {}, long_name, long_link)

    def sparse_map(self, member: Member) -> tuple[tuple[int, int], ...]:
        """The (offset, length) data segments of a sparse member, read from the start of its content.

        Raises:
            CorruptArchive: a malformed map, or segments that do not match the content.
            ResourceLimit: more segments than `MAX_SPARSE_SEGMENTS` (or the archive's total).
        """
        numbers: list[int] = []
        wanted: int | None = None
        pending = b""
        while wanted is None or len(numbers) < wanted:
            if b"\n" not in pending:
                if len(pending) > _MAX_DIGITS:
                    raise CorruptArchive("a sparse map number is too long")
                if self._left < BLOCK:
                    raise CorruptArchive("a sparse map runs past its member")
                pending += self._read_exact(BLOCK)
                self._left -= BLOCK
                continue
            text, _, pending = pending.partition(b"\n")
            value = _decimal(text, "a sparse map entry")
            if wanted is None:
                self._count_segments(value)
                wanted = 2 * value
            else:
                numbers.append(value)
        segments = tuple(zip(numbers[::2], numbers[1::2], strict=True))
        _check_segments(segments, member.realsize, self._left)
        return segments

    def content(self, size: int) -> Iterator[bytes]:
        """The next `size` bytes of the current member's content, in chunks of at most 1 MiB.

        Raises:
            CorruptArchive: the member has fewer bytes left, or the stream ends early.
        """
        if size > self._left:
            raise CorruptArchive("a member's content is shorter than its header says")
        while size > 0:
            chunk = self._read_exact(min(size, 1 << 20))
            size -= len(chunk)
            self._left -= len(chunk)
            yield chunk

    def _member(self, header: _Header, pax: dict[str, str], long_name: str | None, long_link: str | None) -> Member:
        name = pax.get("path", long_name if long_name is not None else header.name)
        linkname = pax.get("linkpath", long_link if long_link is not None else header.linkname)
        size = _decimal(pax["size"].encode(), "a PAX size") if "size" in pax else header.size
        mtime_ns = _pax_mtime_ns(pax["mtime"]) if "mtime" in pax else header.mtime * _NS_PER_S
        kind = header.type
        # tarfile's reading, kept: an old-style file entry named with a slash is a folder.
        if kind == tarfile.AREGTYPE and name.endswith("/"):
            kind = tarfile.DIRTYPE
        if kind == tarfile.DIRTYPE:
            name = name.rstrip("/")
        sparse = _is_sparse(pax)
        realsize = size
        if sparse:
            if kind not in (tarfile.REGTYPE, tarfile.AREGTYPE):
                raise CorruptArchive("a sparse member that is not a file")
            name = pax.get("GNU.sparse.name", "")
            realsize = _decimal(pax.get("GNU.sparse.realsize", "").encode(), "a sparse file size")
        elif kind not in (tarfile.REGTYPE, tarfile.AREGTYPE) and size != 0:
            # Only files have content here: anything else with a size would shift every later header.
            raise CorruptArchive("a member that is not a file has content")
        self._left = size
        self._padding = -size % BLOCK
        return Member(name, kind, header.mode, mtime_ns, size, linkname, realsize, sparse)

    def _count_segments(self, count: int) -> None:
        if count > MAX_SPARSE_SEGMENTS:
            raise ResourceLimit(
                f"a file in the snapshot has over {MAX_SPARSE_SEGMENTS} sparse segments: it cannot be restored"
            )
        self._segments += count
        if self._segments > MAX_SPARSE_SEGMENTS_TOTAL:
            raise ResourceLimit(
                f"the snapshot has over {MAX_SPARSE_SEGMENTS_TOTAL} sparse segments: it cannot be restored"
            )

    def _read_extra(self, size: int, bound: int, what: str) -> bytes:
        """The content of an extended header, refused before it is read when it is over `bound`."""
        if size > bound:
            raise ResourceLimit(f"the snapshot has {what} of {size} bytes, over {bound}: it cannot be restored")
        data = self._read_exact(size)
        self._skip(-size % BLOCK)
        return data

    def _read_block(self, *, allow_eof: bool) -> bytes | None:
        data = self._stream.read(BLOCK)
        if not data and allow_eof:
            return None
        while len(data) < BLOCK:
            more = self._stream.read(BLOCK - len(data))
            if not more:
                raise CorruptArchive("the archive ends inside a header")
            data += more
        return data

    def _read_exact(self, size: int) -> bytes:
        parts: list[bytes] = []
        while size > 0:
            data = self._stream.read(size)
            if not data:
                raise CorruptArchive("the archive ends inside a member")
            parts.append(data)
            size -= len(data)
        return b"".join(parts)

    def _skip(self, size: int) -> None:
        while size > 0:
            size -= len(self._read_exact(min(size, 1 << 20)))


def _parse_header(block: bytes) -> _Header:
    magic = block[257:265]
    if magic not in (_POSIX_MAGIC, _GNU_MAGIC):
        raise CorruptArchive("a header without the ustar magic")
    stored = _number(block[148:156])
    unsigned = sum(block[:148]) + sum(block[156:]) + 8 * 0x20
    signed = unsigned - 256 * sum(1 for byte in (*block[:148], *block[156:]) if byte >= 0x80)
    if stored not in (unsigned, signed):
        raise CorruptArchive("a header checksum does not match")
    name = _field_text(block[0:100])
    prefix = _field_text(block[345:500]) if magic == _POSIX_MAGIC else ""
    return _Header(
        name=f"{prefix}/{name}" if prefix else name,
        type=block[156:157],
        mode=_number(block[100:108]),
        mtime=_number(block[136:148]),
        size=_number(block[124:136]),
        linkname=_field_text(block[157:257]),
    )


def _number(field: bytes) -> int:
    """A numeric header field: octal text, or base-256 when the high bit of its first byte is set."""
    if field[0] & 0x80:
        value = int.from_bytes(field[1:], "big")
        return -((1 << (8 * len(field) - 8)) - value) if field[0] == 0xFF else value
    text = field.split(b"\x00", 1)[0].strip(b" ")
    if not text:
        return 0
    if not all(0x30 <= byte <= 0x37 for byte in text):
        raise CorruptArchive("a numeric header field is not octal")
    return int(text, 8)


def _field_text(field: bytes) -> str:
    return _text(field.split(b"\x00", 1)[0])


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptArchive("a name that is not UTF-8") from exc


def _decimal(text: bytes, what: str) -> int:
    if not 0 < len(text) <= _MAX_DIGITS or not text.isdigit():
        raise CorruptArchive(f"{what} is not a decimal number")
    if (value := int(text)) > _MAX_FILE_OFFSET:
        raise CorruptArchive(f"{what} is past what a file can hold")  # ftruncate would raise OverflowError
    return value


def _pax_mtime_ns(text: str) -> int:
    """A PAX mtime (``-?S[.F]``) in nanoseconds, exactly: a float of 1.7e9 s keeps about 0.2 us."""
    if _MTIME_RE.fullmatch(text) is None:
        raise CorruptArchive("a PAX mtime is not a number")
    negative = text.startswith("-")
    seconds, _, fraction = text.lstrip("-").partition(".")
    # Digits past the ninth are below a nanosecond: dropped (toward zero), as the kernel keeps none.
    ns = int(seconds) * _NS_PER_S + int(fraction[:9].ljust(9, "0"))
    return -ns if negative else ns


def _parse_pax(data: bytes) -> dict[str, str]:
    """Records ``LEN KEY=VALUE\\n`` (POSIX.1-2001 pax, "pax Extended Header"), LEN counting the whole record."""
    records: dict[str, str] = {}
    position = 0
    while position < len(data):
        space = data.find(b" ", position, position + _MAX_DIGITS + 1)
        if space < 0:
            raise CorruptArchive("a PAX record without a length")
        length = _decimal(data[position:space], "a PAX record length")
        record = data[position : position + length]
        if length < space - position + 3 or len(record) != length or not record.endswith(b"\n"):
            raise CorruptArchive("a PAX record whose length is wrong")
        key, equals, value = record[space - position + 1 : -1].partition(b"=")
        if not equals or not key:
            raise CorruptArchive("a PAX record without a keyword")
        records[_text(key)] = _text(value)
        position += length
    if records.get("hdrcharset", _UTF8) != _UTF8:
        raise CorruptArchive("a PAX header that is not UTF-8")
    return records


def _is_sparse(pax: dict[str, str]) -> bool:
    if _SPARSE_KEYS_OLD & pax.keys():
        raise PolicyDenied("the snapshot holds an old-style GNU sparse file, which bastion never writes: refused")
    major, minor = pax.get("GNU.sparse.major"), pax.get("GNU.sparse.minor")
    if major is None and minor is None:
        return False
    if (major, minor) != ("1", "0"):
        raise PolicyDenied("the snapshot holds a GNU sparse file of a version other than 1.0: refused")
    return True


def _check_segments(segments: tuple[tuple[int, int], ...], realsize: int, data_bytes: int) -> None:
    end = 0
    for offset, length in segments:
        if offset < end or offset + length > realsize:
            raise CorruptArchive("sparse segments out of order or past the end of the file")
        end = offset + length
    if sum(length for _, length in segments) != data_bytes:
        raise CorruptArchive("sparse segments do not add up to the member's content")
