import pytest
import torch

from irminsul.kvcache.store import RowLayout
from tests.support.services import RedisProcess

LAYOUT = RowLayout("model-a", n_layers=2, row_width=6, dtype=torch.float32)


@pytest.fixture
def layout():
    return LAYOUT


@pytest.fixture
def redis_proc():
    proc = RedisProcess()  # fails (never skips) when redis-server is missing
    yield proc
    proc.stop()
