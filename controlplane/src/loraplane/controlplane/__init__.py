"""loraplane control plane: the registry of adapters across workers and DP groups, and the router.

Layout (one module per idea):

- ``merge``      fail-first merge of load/unload results (pure)
- ``slots``      pinning, LRU eviction and placement choice (pure)
- ``settings``   pydantic-settings, env prefix ``LORAPLANE_``
- ``models``     SQLAlchemy 2.0 tables; ``db`` engine, sessions, Alembic at start
- ``workers``    the HTTP client for one worker (httpx)
- ``sources``    adapter sources (file, pvc, s3, http(s), hf) and preflight
- ``operations`` the journal and the fan-out of load/unload/pin/version operations
- ``reconciler`` compares the registry with what workers report and repairs drift
- ``events``     registry-change events over Redis pub/sub or in-process
- ``auth``       bearer tokens with scopes and namespaces
- ``metrics``    Prometheus metrics (``loraplane_*``)
- ``api/``       one FastAPI router per resource; ``app`` wires them in a lifespan
"""
