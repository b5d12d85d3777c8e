"""Rules the worker, the control plane and the operator share, written once.

Plain Python with no import of any component (an import-linter contract holds that): the
pin limit (`pins`), the fail-first merge of load/unload results (`merge`), names
(`names`), the adapter_config.json fields no worker implements (`peft`), and the
request-body limit both HTTP servers apply (`body_limit`, the one module that needs Starlette).
"""
