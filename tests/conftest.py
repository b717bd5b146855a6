import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """The tiny transformers models of tests/cases.py, written once per session."""
    from tests.cases import write_all

    return write_all(tmp_path_factory.mktemp("hf_models"))
