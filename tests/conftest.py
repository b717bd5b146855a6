import os
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' own bars (read at its import) off
# inductor compiles in the rank's own process: its default on 2 cores is a pool of compile subprocesses per rank
# (each importing torch), which two ranks on 2 cores pay for twice; tests/test_compile.py took 194-201 s with one
# thread against 213-259 s by default (cold cache, alternating, load 8-15)
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

torch.set_num_threads(1)
SPEAK_AFTER_S = 20.0  # a shared fixture that takes longer than this says so when it ends


def terminal_line(config, line: str) -> None:
    """``line`` on the terminal whatever pytest captures (``-q`` included), as live logging writes."""
    plugins = config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter is None:
        return
    if capture is None:
        reporter.write_line(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


def pytest_configure(config):
    """The vLLM harness's progress lines (an engine start takes minutes) go to the terminal too; the session's
    checkpoint cache (tests/checkpoint_cache.py) is a fresh directory, named in the environment before any rank
    process or fork server starts, so every process of the session finds it."""
    import tempfile

    from tests import checkpoint_cache, vllm_harness

    vllm_harness.say_on_terminal = lambda line: terminal_line(config, line)
    # named now, made by its first user (tests/checkpoint_cache.py): a session that caches nothing leaves nothing
    config._pmz_checkpoint_cache = os.path.join(tempfile.gettempdir(),
                                                f"pmz-checkpoints-{os.getpid()}-{os.urandom(4).hex()}")
    os.environ[checkpoint_cache.ENV] = config._pmz_checkpoint_cache


def pytest_unconfigure(config):
    """The session's checkpoint cache goes with it."""
    from tests import checkpoint_cache

    root = getattr(config, "_pmz_checkpoint_cache", None)
    if root:
        checkpoint_cache.remove(root)
        if os.environ.get(checkpoint_cache.ENV) == root:
            del os.environ[checkpoint_cache.ENV]


def pytest_sessionfinish(session, exitstatus):
    """The session's vLLM client server (tests/vllm_harness.py) ends with the run: one that does not end cleanly
    (exit 0, nothing of its own left running) fails the run."""
    from tests import vllm_harness

    problem = vllm_harness.close_server()
    if problem:
        terminal_line(session.config, problem)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Shared (module/session) fixtures train models and run vLLM engines for minutes: say which one
    starts and how long it took, so a long stretch of the run is never silent."""
    shared = (fixturedef.scope in ("module", "session") and fixturedef.argname != "tmp_path_factory"
              and not fixturedef.argname.startswith("_"))  # housekeeping fixtures (_fresh_ranks_per_module)

    def say(line: str) -> None:
        if shared:
            terminal_line(request.config, line)

    say(f"[{time.strftime('%H:%M:%S')}] {request.node.nodeid.split('::')[0]}: preparing "
        f"'{fixturedef.argname}' (shared by its tests) ...")
    start = time.monotonic()
    yield
    took = time.monotonic() - start
    if took > SPEAK_AFTER_S:
        say(f"[{time.strftime('%H:%M:%S')}] ... '{fixturedef.argname}' ready in {took:.0f} s")

# Property tests are reproducible by default (same examples every run, no example database), so a
# CI run cannot fail by luck; PMZ_HYPOTHESIS=explore searches new examples locally.
settings.register_profile("reproducible", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("PMZ_HYPOTHESIS") == "explore" else "reproducible")


@pytest.fixture(scope="module", autouse=True)
def _fresh_ranks_per_module():
    """The reused rank processes (tests/worker_pool.py) live for one test module: a library's process-wide
    state that one module's rank bodies leave behind (FSDP2/DTensor caches, megatron-core's groups) never
    meets another module's (the first full run with session-long ranks failed two modules that way).
    Then the session's cached checkpoints are checked unchanged: a module that wrote into one fails here
    (its last test errors at teardown), as chmod alone cannot make a root user's write fail."""
    yield
    from tests.checkpoint_cache import changed
    from tests.worker_pool import close_all

    close_all()
    problems = changed()
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="session")
def hf_dirs():
    """The tiny transformers models of tests/cases.py, written once per session (read-only, in the session's
    checkpoint cache: any module or rank process asking for the same model gets these files)."""
    from tests.cases import write_all

    return write_all()


@pytest.fixture()
def paths_taken(monkeypatch) -> list:
    """The copy path's verdict of each ``convert`` call in the test (``engine._convert_by_copy``: True = the copy
    path converted, False = it left the conversion to the torch path), in order."""
    import converters.engine as engine

    taken: list[bool] = []
    real = engine._convert_by_copy

    def spy(*args, **kwargs):
        taken.append(real(*args, **kwargs))
        return taken[-1]

    monkeypatch.setattr(engine, "_convert_by_copy", spy)
    return taken
