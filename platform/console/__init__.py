"""The operator console at /console: server-rendered pages over the same data-access layer as the admin API.

Why server-rendered Jinja2 templates and plain forms (POST, then redirect): every page works with the
keyboard and without a build step, the whole console ships in the wheel as templates and three static
files, and there is one source of truth for what an operator may do (the admin API's data-access
functions). A little JavaScript (`static/console.js`) adds what forms cannot do: an upload progress bar,
charts (Chart.js, vendored in `static/`, no network at run time) and the live engine page.

Sign-in takes an admin key once and keeps a signed, expiring, HttpOnly, SameSite=Strict session cookie;
every form carries the session's CSRF token (`loramux.console.session`).
"""
