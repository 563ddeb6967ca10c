"""The approval queue: persisted, single-use, bound to its literal, expiring, with a webhook."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from bastion.safety.approvals import KEEP_DECIDED_S, MAX_PENDING_PER_REQUESTER, ApprovalQueue
from bastion.safety.errors import ApprovalDenied, Conflict, InvalidRequest, NeedsApproval, NotFound, ResourceLimit
from tests.helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_000_000.0)


@pytest.fixture
def queue(tmp_path: Path, clock: FakeClock) -> ApprovalQueue:
    return ApprovalQueue(tmp_path / "state" / "bastion.db", clock=clock)


def test_request_is_pending_and_persisted(tmp_path: Path, queue: ApprovalQueue, clock: FakeClock) -> None:
    asked = queue.request("biscuit_deploy", "deploy v1.2.3", "stdio", ttl_s=60)
    assert asked.state == "pending"
    assert asked.id.startswith("ap-")
    again = ApprovalQueue(tmp_path / "state" / "bastion.db", clock=clock)  # another process, same file
    assert [a.id for a in again.pending()] == [asked.id]
    assert again.get(asked.id).literal == "deploy v1.2.3"
    assert (tmp_path / "state" / "bastion.db").stat().st_mode & 0o077 == 0


def test_a_client_asking_in_a_loop_is_capped_and_old_requests_are_dropped(
    queue: ApprovalQueue, clock: FakeClock
) -> None:
    """Attack: a client with the deploy scope calls in a loop without an approval id. Each call was a
    pending row (never deleted), a line on the approvals page and a webhook POST. Invariant: at most
    MAX_PENDING_PER_REQUESTER wait per client (then ResourceLimit, nothing added); other clients still
    ask; expiry frees the room; decided requests older than KEEP_DECIDED_S are dropped."""
    for n in range(MAX_PENDING_PER_REQUESTER):
        queue.request("biscuit_deploy", f"deploy v{n}", "http:loop", ttl_s=60)
    with pytest.raises(ResourceLimit):
        queue.request("biscuit_deploy", "deploy v99", "http:loop", ttl_s=60)
    assert len(queue.pending()) == MAX_PENDING_PER_REQUESTER
    other = queue.request("biscuit_deploy", "deploy v1", "http:admin", ttl_s=60)
    denied = queue.deny(other.id, "admin", "no")
    clock.now += 61  # every request above expires
    queue.request("biscuit_deploy", "deploy v100", "http:loop", ttl_s=60)
    assert len(queue.recent(1000)) == MAX_PENDING_PER_REQUESTER + 2
    clock.now += KEEP_DECIDED_S + 1
    kept = queue.request("biscuit_deploy", "deploy v101", "http:loop", ttl_s=60)
    assert [a.id for a in queue.recent(1000)] == [kept.id]  # the expired, used and denied ones are gone
    with pytest.raises(NotFound):
        queue.get(denied.id)


def test_approved_runs_once_for_its_literal_only(queue: ApprovalQueue) -> None:
    asked = queue.request("biscuit_deploy", "deploy v1.2.3", "stdio", ttl_s=60)
    with pytest.raises(NeedsApproval):
        queue.consume(asked.id, "biscuit_deploy", "deploy v1.2.3")
    queue.approve(asked.id, "admin")
    with pytest.raises(InvalidRequest):
        queue.consume(asked.id, "biscuit_deploy", "deploy v9.9.9")
    with pytest.raises(InvalidRequest):
        queue.consume(asked.id, "other_deploy", "deploy v1.2.3")
    used = queue.consume(asked.id, "biscuit_deploy", "deploy v1.2.3")
    assert used.state == "used"
    assert used.decided_by == "admin"
    with pytest.raises(ApprovalDenied, match="already used"):
        queue.consume(asked.id, "biscuit_deploy", "deploy v1.2.3")


def test_denied_never_runs_and_cannot_be_reapproved(queue: ApprovalQueue) -> None:
    asked = queue.request("biscuit_deploy", "deploy v1.2.3", "stdio", ttl_s=60)
    denied = queue.deny(asked.id, "admin", "not on a Friday")
    assert denied.state == "denied"
    assert denied.reason == "not on a Friday"
    with pytest.raises(Conflict):
        queue.approve(asked.id, "admin")
    with pytest.raises(ApprovalDenied, match="not on a Friday"):
        queue.consume(asked.id, "biscuit_deploy", "deploy v1.2.3")
    assert queue.pending() == []


def test_expiry_before_and_after_approval(queue: ApprovalQueue, clock: FakeClock) -> None:
    late = queue.request("biscuit_deploy", "deploy v1", "stdio", ttl_s=10)
    unused = queue.request("biscuit_deploy", "deploy v2", "stdio", ttl_s=10)
    queue.approve(unused.id, "admin")
    clock.now += 10
    assert queue.get(late.id).state == "expired"
    with pytest.raises(Conflict):
        queue.approve(late.id, "admin")
    with pytest.raises(ApprovalDenied, match="expired"):
        queue.consume(unused.id, "biscuit_deploy", "deploy v2")
    assert queue.pending() == []


def test_unknown_and_invalid(queue: ApprovalQueue) -> None:
    with pytest.raises(NotFound):
        queue.get("ap-0000000000000000")
    with pytest.raises(NotFound):
        queue.approve("ap-0000000000000000", "admin")
    with pytest.raises(InvalidRequest):
        queue.request("x", "", "stdio", ttl_s=10)
    with pytest.raises(InvalidRequest):
        queue.request("x", "deploy", "stdio", ttl_s=0)


def test_recent_lists_every_state_newest_first(queue: ApprovalQueue, clock: FakeClock) -> None:
    first = queue.request("a", "deploy 1", "stdio", ttl_s=60)
    clock.now += 1
    second = queue.request("a", "deploy 2", "stdio", ttl_s=60)
    queue.deny(first.id, "admin")
    assert [(a.id, a.state) for a in queue.recent()] == [(second.id, "pending"), (first.id, "denied")]


@pytest.mark.anyio
async def test_wait_returns_when_another_process_approves(tmp_path: Path) -> None:
    queue = ApprovalQueue(tmp_path / "bastion.db")
    other = ApprovalQueue(tmp_path / "bastion.db")
    asked = queue.request("biscuit_deploy", "deploy v1", "stdio", ttl_s=60)
    progress: list[str] = []
    waiting = anyio.Event()

    async def on_progress(waited: float, message: str) -> None:
        progress.append(message)
        waiting.set()

    async def approve_later() -> None:
        await waiting.wait()  # approved while the wait polls, not before it started
        other.approve(asked.id, "admin")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(approve_later)
            decided = await queue.wait(asked.id, 10, on_progress)
    assert decided.state == "approved"
    assert progress
    assert asked.id in progress[0]


@pytest.mark.anyio
async def test_wait_times_out_still_pending(queue: ApprovalQueue) -> None:
    asked = queue.request("biscuit_deploy", "deploy v1", "stdio", ttl_s=60)
    with anyio.fail_after(3):
        assert (await queue.wait(asked.id, 0.3)).state == "pending"


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[dict[str, object]], threading.Event]]:
    received: list[dict[str, object]] = []
    got = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(json.loads(body))
            self.send_response(204)
            self.end_headers()
            got.set()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", received, got
    server.shutdown()
    server.server_close()


def test_webhook_is_told_of_each_request(
    tmp_path: Path, webhook: tuple[str, list[dict[str, object]], threading.Event]
) -> None:
    url, received, got = webhook
    queue = ApprovalQueue(tmp_path / "bastion.db", webhook_url=url)
    asked = queue.request("biscuit_deploy", "deploy v1.2.3", "stdio", ttl_s=60)
    assert got.wait(5)
    assert received[0]["event"] == "approval.requested"
    approval = received[0]["approval"]
    assert isinstance(approval, dict)
    assert approval["id"] == asked.id
    assert approval["literal"] == "deploy v1.2.3"


def test_dead_webhook_does_not_block_requests(tmp_path: Path) -> None:
    queue = ApprovalQueue(tmp_path / "bastion.db", webhook_url="http://127.0.0.1:9/closed")
    asked = queue.request("biscuit_deploy", "deploy v1", "stdio", ttl_s=60)
    assert queue.get(asked.id).state == "pending"


def test_give_back_returns_only_a_used_unexpired_approval(queue: ApprovalQueue, clock: FakeClock) -> None:
    """A use that sent nothing is given back once; a pending, approved, denied or expired one is not."""
    asked = queue.request("biscuit_deploy", "deploy v1.0.0", "stdio", ttl_s=60)
    with pytest.raises(Conflict):
        queue.give_back(asked.id)  # pending
    queue.approve(asked.id, "admin")
    with pytest.raises(Conflict):
        queue.give_back(asked.id)  # approved, not used
    queue.consume(asked.id, "biscuit_deploy", "deploy v1.0.0")
    assert queue.give_back(asked.id).state == "approved"
    assert queue.consume(asked.id, "biscuit_deploy", "deploy v1.0.0").state == "used"
    clock.now += 61
    with pytest.raises(Conflict):
        queue.give_back(asked.id)  # expired meanwhile: it stays spent
    with pytest.raises(NotFound):
        queue.give_back("ap-0000000000000000")
