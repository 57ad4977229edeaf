"""The operator dashboard (server-rendered HTML, served by the coordinator under /dashboard):
`routes` (HTTP, auth, actions), `views` (page data from the service's reads), `health` (the
health rules, pure), `broker_watch` (stuck offsets and lingering transactions), templates/, static/."""

from .routes import create_dashboard

__all__ = ["create_dashboard"]
