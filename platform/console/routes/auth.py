"""Sign in with an admin key (/console/login), and sign out."""
from __future__ import annotations

import secrets

from fastapi import APIRouter, Form, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse

from loramux.console.deps import Operator, RevocationsDep, SecureCookieDep, SignerDep, render
from loramux.console.session import COOKIE, cookie_options, csrf_matches
from loramux.constant_time import same_secret
from loramux.server.deps import ServicesDep
from loramux.server.http.ingress import FAILED_KEYS, Refusal, failure_limit, resolve_admin, retry_after_header

router = APIRouter()

LOGIN_COOKIE = "loramux_console_login"  # the sign-in form's CSRF token (double submit: cookie and field)


def _login_page(request: Request, secure: bool, message: str | None = None, status_code: int = 200):
    token = secrets.token_urlsafe(24)
    response = render(request, "login.html", None, status_code=status_code, login_csrf=token, message=message)
    response.set_cookie(LOGIN_COOKIE, token, max_age=900, httponly=True, samesite="strict", secure=secure,
                        path="/console/login")
    return response


@router.get("/login")
def login_form(request: Request, secure: SecureCookieDep):
    return _login_page(request, secure)


@router.post("/login")
async def login(request: Request, services: ServicesDep, signer: SignerDep, secure: SecureCookieDep,
                admin_key: str = Form(""), csrf_token: str = Form("")):
    expected = request.cookies.get(LOGIN_COOKIE)
    if not expected or not same_secret(expected, csrf_token):  # bytes: non-ASCII input is a 403, not a 500
        return _login_page(request, secure, "The sign-in form expired or did not come from this page; try again.",
                           403)
    limiter, client = failure_limit(request.scope)
    wait = limiter.retry_after(client) if limiter is not None else None
    if wait is not None:
        response = _login_page(request, secure,
                               f"Too many failed sign-ins from this address; try again in {wait:.0f} s.", 429)
        response.headers.update(retry_after_header(wait))
        return response
    admin = await resolve_admin(services, admin_key.strip() or None)
    if limiter is not None and isinstance(admin, Refusal) and admin in FAILED_KEYS:
        limiter.record_failure(client)
    if isinstance(admin, Refusal):
        text = ("Tenant API keys cannot sign in to the console: use an admin key (lmxa-...)."
                if admin.status == 403 else "That admin key is unknown or revoked.")
        return _login_page(request, secure, text, 401 if admin.status == 401 else 403)
    cookie, _ = signer.issue(admin.id)
    response = RedirectResponse("/console/tenants", status_code=303)
    response.set_cookie(value=cookie, **cookie_options(signer.max_age_s, secure))
    response.delete_cookie(LOGIN_COOKIE, path="/console/login")
    return response


@router.post("/logout")
async def logout(request: Request, operator: Operator, signer: SignerDep, revocations: RevocationsDep,
                 secure: SecureCookieDep):
    """Sign out: the session is revoked server-side (a copy of its cookie is refused too), then forgotten."""
    form = await request.form()
    response = RedirectResponse("/console/login", status_code=303)
    if csrf_matches(operator[0], form.get("csrf_token")):
        await run_in_threadpool(revocations.revoke, operator[0].session_id, signer.max_age_s)
        response.delete_cookie(COOKIE, path="/console", secure=secure, httponly=True,
                               samesite="strict")
    return response
