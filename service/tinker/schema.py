"""The Tinker SDK's protobuf schema module (tinker/proto/tinker_public_pb2, Apache-2.0, from the `tinker` extra),
loaded without the SDK package around it.

Importing it the ordinary way runs the `tinker` package's __init__, which imports torch wherever torch is installed
(the SDK's tensor types convert to and from torch); the API process never loads torch (tests/api/test_health.py).
So the file is executed by its path. Its messages register in protobuf's default pool under the schema's own names,
where the SDK's copy finds them: a process that also imports the SDK gets the same message classes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SDK_MODULE = "tinker.proto.tinker_public_pb2"


def _load() -> ModuleType:
    if SDK_MODULE in sys.modules:  # the SDK is loaded already: its module, not a second copy
        return sys.modules[SDK_MODULE]
    package = importlib.util.find_spec("tinker")  # finds the package without running its __init__
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError("the Tinker API needs the Tinker SDK: pip install 'cispo-service[tinker]'",
                                  name="tinker")
    path = Path(next(iter(package.submodule_search_locations))) / "proto" / "tinker_public_pb2.py"
    spec = importlib.util.spec_from_file_location(f"{__name__}.tinker_public_pb2", path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"the Tinker SDK has no schema module at {path}", name=SDK_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pb = _load()
