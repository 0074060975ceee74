"""``require_positive_ints``: the one check of a config's integer fields (the serve model, the vLLM build)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvown.core.errors import ConfigError, require_positive_ints


@pytest.mark.parametrize(("value", "ok"), [(1, True), (0, False), (-1, False), (True, False), (2.0, False)])
def test_each_field_must_be_an_int_above_zero(value: object, ok: bool) -> None:
    config = SimpleNamespace(a=3, b=value)
    if ok:
        require_positive_ints(config, ("a", "b"))
        return
    with pytest.raises(ConfigError) as caught:
        require_positive_ints(config, ("a", "b"))
    assert caught.value.field == "b" and caught.value.value == value and "positive integer" in str(caught.value)


def test_zero_is_allowed_only_where_named() -> None:
    require_positive_ints(SimpleNamespace(seed=0), ("seed",), zero_ok=("seed",))
    with pytest.raises(ConfigError):
        require_positive_ints(SimpleNamespace(seed=-1), ("seed",), zero_ok=("seed",))
