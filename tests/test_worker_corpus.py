"""Every worker of a job reads the same data: the first records its digest, a worker on different
data (for the built-in corpus, another Python patch version) stops before it trains a sample whose
bytes differ from its peers'."""

from __future__ import annotations

import pytest
import redis

from chameleond.protocol import Keys
from chameleond.worker._data import Corpus
from chameleond.worker._startup import agree_on_corpus
from chameleond.worker.api import DataError


def test_a_worker_on_another_corpus_stops(redis_client: redis.Redis) -> None:
    keys = Keys("corpus")
    digest = Corpus().digest
    agree_on_corpus(redis_client, keys, digest)  # the first worker records its corpus
    agree_on_corpus(redis_client, keys, digest)  # the same corpus on another host: fine
    assert redis_client.get(keys.corpus) == digest
    with pytest.raises(DataError, match=f"read {digest}: every worker must read the same dataset"):
        agree_on_corpus(redis_client, keys, "0123456789abcdef")
    assert redis_client.get(keys.corpus) == digest  # the job's record stays
