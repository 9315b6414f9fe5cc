"""What every console page needs: the signed-in operator (or a redirect to sign in), CSRF checks, templates."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.templating import Jinja2Templates

from loramux.console.revocations import SessionRevocations
from loramux.console.session import (
    COOKIE,
    CSRF_FIELD,
    CSRF_HEADER,
    ConsoleSession,
    SessionSigner,
    csrf_matches,
    secure_cookies,
)
from loramux.server.deps import ServicesDep
from loramux.server.http.forwarded import request_scheme
from loramux.tenancy.admin_keys import AdminKeyInfo

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))


class SignInRequired(Exception):
    """No live session: pages answer with a redirect to /console/login, data routes with 401."""


class CsrfRejected(Exception):
    """A state-changing request without the session's CSRF token (403)."""


def get_signer(request: Request) -> SessionSigner:
    """The session signer the app's startup made (LORAMUX_CONSOLE_SECRET)."""
    return request.app.state.console_signer


def get_revocations(request: Request) -> SessionRevocations:
    return request.app.state.console_revocations


SignerDep = Annotated[SessionSigner, Depends(get_signer)]
RevocationsDep = Annotated[SessionRevocations, Depends(get_revocations)]


def secure_cookie(request: Request, services: ServicesDep) -> bool:
    """Whether this response's cookies get `Secure` (LORAMUX_CONSOLE_SECURE_COOKIES, trusted proxies)."""
    scheme = request_scheme(request.scope, getattr(request.app.state, "trusted_proxies", ()))
    return secure_cookies(services.settings.console_secure_cookies, scheme)


SecureCookieDep = Annotated[bool, Depends(secure_cookie)]


async def current_operator(request: Request, signer: SignerDep, revocations: RevocationsDep,
                           services: ServicesDep) -> tuple[ConsoleSession, AdminKeyInfo]:
    session = signer.read(request.cookies.get(COOKIE))
    if session is None:
        raise SignInRequired
    if await run_in_threadpool(revocations.is_revoked, session.session_id):  # signed out
        raise SignInRequired
    admin = await run_in_threadpool(services.admin_keys.live, session.admin_key_id)
    if admin is None:  # the key was revoked since: its sessions end with it
        raise SignInRequired
    return session, admin


Operator = Annotated[tuple[ConsoleSession, AdminKeyInfo], Depends(current_operator)]


async def checked_form(request: Request, operator: Operator) -> dict:
    """The posted form's fields, once its CSRF token matched the session's (else CsrfRejected)."""
    form = await request.form()
    token = form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER)
    if not csrf_matches(operator[0], token):
        raise CsrfRejected
    return {key: value for key, value in form.items() if key != CSRF_FIELD}


CheckedForm = Annotated[dict, Depends(checked_form)]


def render(request: Request, template: str, operator: Operator | None, status_code: int = 200, **context):
    session = operator[0] if operator else None
    return TEMPLATES.TemplateResponse(request, template, {"csrf": session.csrf if session else "",
                                                          "operator": operator[1] if operator else None,
                                                          **context}, status_code=status_code)
