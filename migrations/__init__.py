"""Alembic environment and versions (shipped in the wheel as `loramux.migrations`).

Apply with `loramux db upgrade`; the server applies them at start. New revision (developers):
`.venv/bin/alembic -c migrations/alembic.ini revision --autogenerate -m "what changed"`.
"""
