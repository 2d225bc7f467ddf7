"""Test setup: Triton kernels run in the interpreter on the CPU, torch uses one thread (the tiny
shapes run fastest that way on a shared 2-core machine), logs stay quiet unless a test captures them."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# A developer's shell, unlike CI's, may hold what changes every server test: HICACHE_API_KEY (hicache-serve's key
# where --api-key is not given; a test that wants it sets it with monkeypatch) and a proxy for httpx and the openai
# client (the tests' servers are on 127.0.0.1; a proxy would carry those calls off this machine). The servers that
# tests start in a subprocess inherit what is left.
for _var in ("HICACHE_API_KEY", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
    os.environ.pop(_var, None)
# argparse wraps help and usage at $COLUMNS (80 where stdout is no terminal, as in CI): a narrow shell's value
# split the `usage: hicache-replay ...` line that the scripts' tests read (envhunt63).
os.environ["COLUMNS"] = "80"

import pytest  # noqa: E402
import structlog  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
from scheduler.logs import drop_below_warning  # noqa: E402

# Level filtering is a processor (not a filtering wrapper), so structlog.testing.capture_logs(),
# which swaps the processor chain, still sees info events.
structlog.configure(
    processors=[drop_below_warning, structlog.processors.add_log_level,
                structlog.dev.ConsoleRenderer(colors=False)],
    cache_logger_on_first_use=False,
)


@pytest.fixture(autouse=True)
def _quiet_logging_restored():
    """Whatever logging a test configures (a replay's or a server's --log-json, its own setup), the next test finds
    the quiet configuration above (regression: a replay test's --log-json left info logging on, and tests that rely
    on the quiet production log failed after it in a random order)."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run the full-size soak and other slow tests")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)


@pytest.fixture(scope="module")
def client(srv):
    """The openai SDK's client of the module's server (its `srv` fixture), retries off: a test sees every answer."""
    import openai

    with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c
