import os

import pytest
import torch
from hypothesis import settings

torch.set_num_threads(1)

# Property tests are reproducible by default (same examples every run, no example database), so a
# CI run cannot fail by luck; PMZ_HYPOTHESIS=explore searches new examples locally.
settings.register_profile("reproducible", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("explore" if os.environ.get("PMZ_HYPOTHESIS") == "explore" else "reproducible")


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """The tiny transformers models of tests/cases.py, written once per session."""
    from tests.cases import write_all

    return write_all(tmp_path_factory.mktemp("hf_models"))
