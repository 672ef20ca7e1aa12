"""Confined checkpoint storage (services/checkpoint_coordinator/confine.py): a shard location is taken only under
its job's own prefix, <root>/<tenant>/<job>/."""

from __future__ import annotations

import os

import pytest

from services.checkpoint_coordinator.confine import StorageRoot


@pytest.fixture
def root(tmp_path):
    (tmp_path / "ckpt" / "alice" / "j1" / "5").mkdir(parents=True)
    (tmp_path / "ckpt" / "alice" / "j2").mkdir(parents=True)
    return tmp_path / "ckpt"


def test_a_file_root_takes_only_the_jobs_own_files(root, tmp_path):
    r = StorageRoot.parse(str(root))
    assert r.prefix("alice", "j1") == f"file://{root}/alice/j1/" and r.prefix("", "j1") == f"file://{root}/j1/"
    assert r.check((root / "alice" / "j1" / "5" / "rank-0.json").as_uri(), "alice", "j1") == ""
    assert r.check(f"file://localhost{root}/alice/j1/5/x", "alice", "j1") == ""
    refused = {
        "file:///etc/passwd": "outside",
        (root / "alice" / "j2" / "x").as_uri(): "outside",  # another job's prefix
        (root / "bob" / "j1" / "x").as_uri(): "outside",  # another tenant's
        f"file://{root}/alice/j1/../j2/x": "'..'",
        f"s3://bucket{root}/alice/j1/x": "scheme 's3'",
        f"file://evil{root}/alice/j1/x": "host 'evil'",
        f"{root}/alice/j1/x": "scheme 'none'",
        (root / "alice" / "j1").as_uri(): "outside",  # the prefix itself is no shard
    }
    for uri, why in refused.items():
        got = r.check(uri, "alice", "j1")
        assert why in got and "outside this job's storage prefix" in got, (uri, got)


def test_a_symlink_that_leads_out_is_outside(root, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x")
    link = root / "alice" / "j1" / "5" / "rank-0.json"
    os.symlink(secret, link)
    assert "outside" in StorageRoot.parse(str(root)).check(link.as_uri(), "alice", "j1")
    dir_link = root / "alice" / "j1" / "escape"
    os.symlink(tmp_path, dir_link)
    assert "outside" in StorageRoot.parse(str(root)).check((dir_link / "secret").as_uri(), "alice", "j1")


def test_an_object_store_root_compares_normalized_keys():
    r = StorageRoot.parse("s3://bucket/ckpt")
    assert r.check("s3://bucket/ckpt/alice/j1/5/rank-0.pt", "alice", "j1") == ""
    assert "outside" in r.check("s3://bucket/ckpt/alice/j10/x", "alice", "j1")
    assert "outside" in r.check("s3://other/ckpt/alice/j1/x", "alice", "j1")
    assert "outside" in r.check("s3://bucket/ckpt/alice/j1/../j2/x", "alice", "j1")
    assert r.check("s3://bucket/ckpt/alice/j1/x", "../alice", "j1") == "the job or its tenant names no storage prefix"


@pytest.mark.parametrize("text", ["", "relative/dir", "file://host/ckpt", "s3://b/../x"])
def test_a_root_that_names_no_storage_is_refused(text):
    with pytest.raises(ValueError):
        StorageRoot.parse(text)
