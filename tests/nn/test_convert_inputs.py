"""What a new user passes to convert: a recipe file of another suffix, a callable selection
(issue 32, part 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8lab.nn import convert, converted, select_linears


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Linear(32, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    )


def test_a_recipe_file_of_another_suffix_says_recipe_files_are_toml_or_json(tmp_path):
    f = tmp_path / "x.txt"
    f.write_text('base = "te-delayed"\n')
    for given in ("x.txt", str(f), f):
        with pytest.raises(
            ValueError, match=r"neither a recipe file \(those end in \.toml or \.json.*te-delayed"
        ):
            convert(_net(), given)
    toml = tmp_path / "r.toml"
    toml.write_text('base = "te-delayed"\n')
    assert converted(convert(_net(), Path(toml))) == ["0", "1", "2"]  # a Path works too
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        convert(_net(), "nope")  # a plain unknown name keeps the preset message


def test_include_and_exclude_take_a_callable_name_module():
    wide = lambda name, m: m.out_features >= 32  # noqa: E731
    assert select_linears(_net(), include=wide) == ["0"]
    assert converted(convert(_net(), "te-current", include=wide)) == ["0"]
    assert select_linears(_net(), exclude=wide) == ["1", "2"]
    seen = []
    select_linears(_net(), include=[lambda n, m: seen.append((n, type(m))) or True, "1"])
    assert {n for n, _ in seen} == {"0", "1", "2", "3"}  # asked about Linear layers only
    assert all(t is torch.nn.Linear for _, t in seen)
    with pytest.raises(ValueError, match=r"include callable .* selects no Linear layer"):
        convert(_net(), "te-current", include=lambda n, m: False)


def test_include_of_another_type_is_a_clear_type_error():
    with pytest.raises(
        TypeError, match=r"include must be a str \(glob\), a re\.Pattern, a callable"
    ):
        convert(_net(), "te-current", include=3)
    with pytest.raises(TypeError, match="exclude patterns must be str"):
        convert(_net(), "te-current", exclude=["0", 3])
