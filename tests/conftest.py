import json
import os

import pytest

HERE = os.path.dirname(__file__)
DATA = os.path.join(HERE, "data")


@pytest.fixture(scope="session")
def param_counts():
    """Parameter counts and shapes recorded from transformers (tools/record_param_counts.py)."""
    with open(os.path.join(DATA, "param_counts.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def cases():
    """The 45 measured H200 training cases shipped in the package."""
    from vramwidget.measure.validate import BUILTIN_CASES, load_cases

    return load_cases(BUILTIN_CASES)


def pytest_collection_modifyitems(config, items):
    """Run the browser tests last: Playwright's sync API keeps an asyncio loop marked as
    running in the main thread for as long as its session-wide browser lives, which would
    confuse tests that use asyncio afterwards (the widget's deferred suggestions)."""
    items.sort(key=lambda item: "browser" in item.nodeid.split("::")[0].split("/"))


# Property tests explore new examples on every local run; CI replays a fixed derandomized
# set so that a submission's result does not depend on the luck of the draw.
try:
    from hypothesis import settings as _hsettings

    _hsettings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("CI", "").lower() in ("1", "true"):
        _hsettings.load_profile("ci")
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass
