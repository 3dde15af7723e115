"""The OpenAI-compatible HTTP gateway (FastAPI + httpx)."""

from gateway.proxy.app import create_app

__all__ = ["create_app"]
