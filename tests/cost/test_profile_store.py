"""The profile cache keeps data, not code: a profile round-trips through its JSON file, and
a damaged or planted file is set aside and the profile computed again.

(A truncated file must not stop `ptc explain` with a traceback, and a file planted in
the cache must not run code when read.)
"""

from __future__ import annotations

import json

import pytest

from ptc.compiler.profile import cache
from ptc.compiler.profile.store import Unreadable, read_profile, write_profile
from ptc.plan import ModelSpec

GPT = ModelSpec(family="gpt", layers=2, hidden=32, heads=4, vocab=64, max_seq=16)
CUSTOM = ModelSpec(family="custom", factory="tests.user_models.transformers_models:llama",
                   kwargs={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 2, "num_attention_heads": 4})


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PTC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_CACHE", {})
    return tmp_path


@pytest.mark.parametrize("spec", [GPT, CUSTOM], ids=["gpt", "transformers llama"])
def test_a_profile_reads_back_equal(fresh_cache, tmp_path, spec) -> None:
    profile = cache.model_profile(spec, "fp32")
    path = tmp_path / "copy.json"
    write_profile(path, profile)
    again = read_profile(path)
    assert again == profile  # every field but the compiled functions and the memo
    json.loads(path.read_text())  # plain JSON


def test_a_damaged_file_is_set_aside_and_the_profile_made_again(fresh_cache) -> None:
    first = cache.model_profile(GPT, "fp32")
    (path,) = fresh_cache.glob("*.json")
    path.write_text(path.read_text()[:100])  # truncated, as by a full disk
    cache._CACHE.clear()
    assert cache.model_profile(GPT, "fp32") == first
    assert path.with_suffix(".damaged").exists() and path.exists()


def test_a_file_naming_other_types_builds_nothing(tmp_path) -> None:
    planted = tmp_path / "planted.json"
    planted.write_text(json.dumps({"version": 1, "profile": {
        "record": "Popen", "fields": {"args": ["touch", str(tmp_path / "ran")]}}}))
    with pytest.raises(Unreadable, match="KeyError"):
        read_profile(planted)
    assert not (tmp_path / "ran").exists()
