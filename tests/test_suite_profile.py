"""bench/suite_profile.py books JAX's own trace / lower / compile duration events (`jax.monitoring`) to the test
that is running, and its summary adds them up per file."""
import json

import jax
import jax.numpy as jnp
import jax.monitoring

from bench import suite_profile


def test_a_compile_is_booked_to_the_running_test_and_summed_per_file(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_profile, "_current", ["tests/test_x.py::test_a"])
    monkeypatch.setattr(suite_profile, "_rows", type(suite_profile._rows)(suite_profile._rows.default_factory))
    jax.monitoring.register_event_duration_secs_listener(suite_profile._listener)
    try:
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(7, dtype=jnp.float32)).block_until_ready()
    finally:
        jax.monitoring.unregister_event_duration_listener(suite_profile._listener)
    row = suite_profile._rows["tests/test_x.py::test_a"]
    assert row["programs"] >= 1 and row["compile"] > 0 and row["trace"] > 0 and row["lower"] > 0, row
    row["wall"] = 2.5
    other = dict.fromkeys(suite_profile.COLUMNS, 1.0)
    (tmp_path / "gw0-1.json").write_text(json.dumps(suite_profile._rows))
    (tmp_path / "gw1-2.json").write_text(json.dumps({"tests/test_x.py::test_b": other}))
    text = suite_profile.summarize(tmp_path, top=5)
    assert text.startswith("2 tests: wall 4 s")
    programs = int(row["programs"]) + 1
    assert f"| tests/test_x.py | 3.5 | {row['trace'] + 1:.1f} | {row['lower'] + 1:.1f} | {row['compile'] + 1:.1f} " \
           f"| {programs} |" in text, text
