"""swarm.server.preload: the imports a join needs later, done on a thread while the join waits on the network."""

import logging
import subprocess
import sys
import textwrap

import pytest

from swarm.server.preload import Preload


def test_the_modules_are_imported_and_a_missing_one_is_left_to_its_user(caplog):
    sys.modules.pop("colorsys", None)
    with caplog.at_level(logging.DEBUG, logger="swarm.server.preload"):
        preload = Preload(["swarm_no_such_module", "colorsys"])
        assert preload.wait(timeout_s=30)
    assert "colorsys" in sys.modules and preload.seconds > 0
    assert "preloading swarm_no_such_module failed" in caplog.text


@pytest.mark.timeout(120)
def test_after_the_preload_a_server_s_first_torch_optimizer_imports_nothing():
    """The reason for the preload, in a fresh interpreter: the first torch optimizer imports ``torch._dynamo``
    (if a torch release stops doing so, the first assertion says the preload list is stale), and after the
    preload building one imports no module at all."""
    script = textwrap.dedent("""
        import sys, torch
        if sys.argv[1] == "bare":
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
            print("torch._dynamo" in sys.modules)
        else:
            from swarm.server.preload import Preload
            assert Preload().wait()
            before = set(sys.modules)
            torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.1)
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
            print(sorted(set(sys.modules) - before))
    """)
    run = [sys.executable, "-c", script]
    bare = subprocess.run([*run, "bare"], capture_output=True, text=True, timeout=100, check=True)
    assert bare.stdout.strip() == "True"
    preloaded = subprocess.run([*run, "preloaded"], capture_output=True, text=True, timeout=100, check=True)
    assert preloaded.stdout.strip() == "[]"
