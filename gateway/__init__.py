"""The Gateway: an OpenAI-compatible proxy in front of the inference servers.

``create_app()`` is the factory gunicorn calls (``gateway:create_app()``); tests build their
own app with explicit settings. All shared state (pause flag, leases, captures) is in Redis,
so any number of worker processes and hosts act as one gateway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.config.schema import Config

if TYPE_CHECKING:
    from flask import Flask

    from gateway.settings import GatewaySettings

__version__ = "0.1.0"
__all__ = ["create_app"]


def create_app(settings: GatewaySettings | None = None, cfg: Config | None = None) -> Flask:
    # imported here, not with the package: gunicorn's master imports the package for its
    # worker class (gateway.worker) before the worker's gevent monkey-patching, which must
    # come before flask and redis are imported
    from flask import Flask

    from gateway.settings import GatewaySettings
    from gateway.state import GatewayState

    if settings is None:
        if cfg is None:
            from app.config import service_config

            cfg = service_config()
        settings = GatewaySettings.from_config(cfg)
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    GatewayState(settings).install(app)

    from gateway.errors import register_error_handlers
    from gateway.routes.admin import bp as admin_bp
    from gateway.routes.anthropic import bp as anthropic_bp
    from gateway.routes.health import bp as health_bp
    from gateway.routes.openai import bp as openai_bp
    from gateway.routes.responses import bp as responses_bp
    from gateway.routes.rewards import bp as rewards_bp

    register_error_handlers(app)
    app.register_blueprint(health_bp)
    app.register_blueprint(openai_bp)
    app.register_blueprint(anthropic_bp)
    app.register_blueprint(responses_bp)
    app.register_blueprint(rewards_bp)
    app.register_blueprint(admin_bp)
    return app
