"""The administrator's window: /admin (overview and grants), sandboxes, the audit log, egress, clients.

SECURITY BOUNDARY. Every page needs the administrator's session (`AdminPages.session_csrf`), or it
redirects to the login; every action is a POST behind the session's CSRF token (`AdminPages.checked_post`)
and is written to the audit log before it runs (event ``admin``; no record, no action). Values agents
and clients chose (labels, names, audit fields) reach Jinja2 templates as data, autoescaped. Reads are
bounded: an audit page reads at most `audit_view.SCAN_BYTES`, the chain is verified from a cache
(`audit_view.ChainStatus`), a sandbox's disk use is a bounded walk, all off the event loop. Looking
at a sandbox does not count as using it (its idle timer keeps running).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Final
from urllib.parse import urlencode

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bastion.safety.audit import AuditLog
from bastion.safety.errors import BastionError, SandboxNotFound
from bastion.safety.results import ResultCode
from bastion.transports.http import audit_view, pages, views
from bastion.transports.http.admin_pages import AdminPages
from bastion.transports.http.flow import speculative
from bastion.workbench.manager import Sandbox, SandboxManager

ADMIN_CALLER: Final = "administrator (web)"
REFRESH_S: Final = 15
NAVIGATION_ONLY: Final = "the administrator's pages answer a navigation only, not another site's page's requests"
_SANDBOX_ID: Final = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_STATUS: Final = {
    ResultCode.SANDBOX_NOT_FOUND: 404,
    ResultCode.NOT_FOUND: 404,
    ResultCode.CONFLICT: 409,
    ResultCode.AUDIT_UNAVAILABLE: 503,
}
Action = Callable[[SandboxManager, str], Awaitable[object]]


async def _close(manager: SandboxManager, sandbox_id: str) -> object:
    await manager.close(sandbox_id)
    return None


async def _pause(manager: SandboxManager, sandbox_id: str) -> object:
    return await manager.pause(sandbox_id)


async def _resume(manager: SandboxManager, sandbox_id: str) -> object:
    return await manager.resume(sandbox_id)


ACTIONS: Final[dict[str, Action]] = {"close": _close, "pause": _pause, "resume": _resume}


class Dashboard:
    def __init__(self, admin: AdminPages, sandboxes: SandboxManager | None, audit: AuditLog) -> None:
        self.admin = admin
        self.sandboxes = sandboxes
        self.audit = audit
        self.chain = audit_view.ChainStatus(audit.path)

    def routes(self) -> list[Route]:
        post = self.admin.checked_post
        return [
            Route("/static/bastion.css", views.stylesheet, methods=["GET"]),
            Route("/admin", self._page(self.overview), methods=["GET"]),
            Route("/admin/sandboxes", self._page(self.sandbox_list), methods=["GET"]),
            Route("/admin/sandboxes/{sandbox_id}", self._page(self.sandbox_page), methods=["GET"]),
            *(
                Route(f"/admin/sandboxes/{{sandbox_id}}/{name}", post(self._action(name)), methods=["POST"])
                for name in ACTIONS
            ),
            Route("/admin/audit", self._page(self.audit_page), methods=["GET"]),
            Route("/admin/egress", self._page(self.egress_page), methods=["GET"]),
            Route("/admin/clients", self._page(self.clients_page), methods=["GET"]),
            Route("/admin/approvals", self._page(self.approvals_page), methods=["GET"]),
        ]

    def _page(self, handler: Callable[[Request, str], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """Wrap a GET handler: the session's CSRF token, or a redirect to the login; a refusal as a page."""

        async def checked(request: Request) -> Response:
            if _background_from_another_site(request) or speculative(request.headers):
                return pages.error_page(NAVIGATION_ONLY, status=403)
            csrf = self.admin.session_csrf(request)
            if csrf is None:
                return pages.see_other("/admin/login")
            try:
                return await handler(request, csrf)
            except BastionError as exc:
                return refused(request, csrf, exc)

        return checked

    # -- pages ----------------------------------------------------------------------------------------

    async def overview(self, request: Request, csrf: str) -> Response:
        chain = await anyio.to_thread.run_sync(self.chain.check)
        store = self.admin.store
        return views.render(
            "overview.html",
            title="administration",
            current="/admin",
            csrf=csrf,
            message="",
            sandboxes=len(self.sandboxes.all()) if self.sandboxes else 0,
            pending=len(self.admin.approvals.pending()),
            clients=len(store.clients()),
            grants=store.grants(),
            chain=chain,
        )

    async def sandbox_list(self, request: Request, csrf: str) -> Response:
        boxes = self.sandboxes.all() if self.sandboxes else []
        details = await anyio.to_thread.run_sync(self._details, boxes)
        return views.render(
            "sandboxes.html",
            title="sandboxes",
            current="/admin/sandboxes",
            csrf=csrf,
            message="",
            enabled=self.sandboxes is not None and self.sandboxes.enabled,
            boxes=details,
            refresh_s=REFRESH_S,
        )

    async def sandbox_page(self, request: Request, csrf: str) -> Response:
        box = self._find(request.path_params["sandbox_id"])
        details = await anyio.to_thread.run_sync(self._details, [box])
        if not details:
            raise SandboxNotFound("this sandbox was closed meanwhile")
        return views.render(
            "sandbox.html",
            title=f"sandbox {box.id}",
            current="/admin/sandboxes",
            csrf=csrf,
            message="",
            box=details[0],
        )

    async def audit_page(self, request: Request, csrf: str, *, egress: bool = False) -> Response:
        params = request.query_params
        audit_view.refuse_repeated(params.multi_items())
        wanted = audit_view.parse_filter(params, kind="egress" if egress else "all")
        before = audit_view.parse_cursor(params.get("before"))
        path = self.audit.path
        page = await anyio.to_thread.run_sync(lambda: audit_view.read_page(path, wanted, before=before))
        chain = await anyio.to_thread.run_sync(self.chain.check)
        older = urlencode({**wanted.query(), "before": page.next_before or 0})
        current = "/admin/egress" if egress else "/admin/audit"
        return views.render(
            "audit.html",
            title="egress attempts" if egress else "audit log",
            current=current,
            csrf=csrf,
            message="",
            egress=egress,
            wanted=wanted,
            kinds=audit_view.KINDS,
            codes=[code.value for code in ResultCode],
            decisions=audit_view.DECISIONS,
            page=page,
            before=before,
            older_query=older,
            chain=chain,
            log_name=path.name,
        )

    async def egress_page(self, request: Request, csrf: str) -> Response:
        return await self.audit_page(request, csrf, egress=True)

    async def clients_page(self, request: Request, csrf: str) -> Response:
        store = self.admin.store
        grants = Counter(grant.client_id for grant in store.grants())
        return views.render(
            "clients.html",
            title="clients",
            current="/admin/clients",
            csrf=csrf,
            message="",
            clients=store.clients(),
            grants=grants,
        )

    async def approvals_page(self, request: Request, csrf: str) -> Response:
        queue = self.admin.approvals
        return views.render(
            "approvals.html",
            title="approvals",
            current="/admin/approvals",
            csrf=csrf,
            message="",
            pending=queue.pending(),
            decided=[a for a in queue.recent(20) if a.state != "pending"],
        )

    # -- actions --------------------------------------------------------------------------------------

    def _action(self, name: str) -> Callable[[Request, dict[str, str], str], Awaitable[Response]]:
        act = ACTIONS[name]

        async def handle(request: Request, form: dict[str, str], csrf: str) -> Response:
            try:
                box = self._find(request.path_params["sandbox_id"])
                record: dict[str, object] = {
                    "event": "admin",
                    "tool": f"{name}_sandbox",
                    "caller": ADMIN_CALLER,
                    "workspace": box.id,
                }
                await self.audit.append_async({**record, "phase": "start"})
                try:
                    await act(self._manager(), box.id)
                except BastionError as exc:
                    await self.audit.append_async(
                        {**record, "phase": "end", "code": exc.code.value, "reason": exc.reason}
                    )
                    raise
                await self.audit.append_async({**record, "phase": "end", "code": ResultCode.OK.value}, ran=True)
            except BastionError as exc:
                return refused(request, csrf, exc)
            return pages.see_other("/admin/sandboxes" if name == "close" else f"/admin/sandboxes/{box.id}")

        return handle

    def _manager(self) -> SandboxManager:
        if self.sandboxes is None or not self.sandboxes.enabled:
            raise SandboxNotFound("sandboxes are disabled on this server")
        return self.sandboxes

    def _find(self, sandbox_id: str) -> Sandbox:
        if not _SANDBOX_ID.fullmatch(sandbox_id):
            raise SandboxNotFound("no such sandbox")
        try:
            return self._manager().find(sandbox_id)
        except SandboxNotFound:
            raise SandboxNotFound("no such sandbox: it was closed, or never existed") from None

    def _details(self, boxes: list[Sandbox]) -> list[dict[str, object]]:
        """Each sandbox's detail with live usage (blocking: in a worker thread); one closed meanwhile is left out."""
        if not boxes:
            return []
        manager = self._manager()
        out = []
        for box in boxes:
            try:
                detail = manager.detail(box)
            except (OSError, BastionError):
                continue
            detail.setdefault("isolation", "namespaces")
            detail["owner"] = box.owner
            out.append(detail)
        return out


def _background_from_another_site(request: Request) -> bool:
    """A request another site's page made other than by a top-level navigation (fetch, img, a frame),
    by Fetch Metadata.

    A sandbox's preview page is same-site (the same host, another port), so the SameSite=Strict session
    cookie goes with its requests: a loop of them would make the server scan the log and walk sandbox
    disks, outside any sandbox's cgroup. A frame is refused too: X-Frame-Options stops only its display,
    not the work behind it. A browser that sends no Fetch Metadata is let through.
    """
    headers = request.headers
    if headers.get("sec-fetch-site", "") not in ("same-site", "cross-site"):
        return False
    mode, dest = headers.get("sec-fetch-mode", ""), headers.get("sec-fetch-dest", "document")
    return not (mode == "navigate" and dest == "document")


def refused(request: Request, csrf: str, exc: BastionError) -> Response:
    """A refusal as a page inside the dashboard, with the status its result code means."""
    status = _STATUS.get(exc.code, 400)
    return views.render(
        "refused.html",
        status=status,
        title="request refused",
        current="",
        csrf=csrf,
        message="",
        reason=exc.reason,
        back="/admin/sandboxes" if request.url.path.startswith("/admin/sandboxes") else "/admin",
    )
