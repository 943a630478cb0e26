"""An OpenAI-compatible server over the continuous-batching engine (``lockstep serve``).

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client): ``pip install -e ".[serve]"``.
See docs/serving.md.
"""
