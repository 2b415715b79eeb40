import pytest

from irminsul.train.data import default_data_dir


@pytest.fixture(scope="session")
def shared_data():
    """The read-only data folder the evaluations build their tasks from (skip when absent)."""
    try:
        return default_data_dir()
    except FileNotFoundError:
        pytest.skip("shared/data is not next to the repository")
