"""Rules the worker, the control plane and the operator share, written once.

Plain Python with no import of any component (an import-linter contract holds that): the
pin limit (`pins`), the fail-first merge of load/unload results (`merge`), names
(`names`) and the adapter_config.json fields no worker implements (`peft`).
"""
