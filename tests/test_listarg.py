"""Comma-separated arguments: one parser (kvrepro.listarg.comma_list) behind every list of the kit's command lines, so
an empty item is an error naming the argument, never a silently shorter list."""
import pytest

from kvrepro import accuracy_vllm, profile, servebench
from kvrepro.listarg import comma_list


@pytest.mark.parametrize("text,want", [("a", ["a"]), ("a,b", ["a", "b"]), (" a , b ", ["a", "b"]),
                                       ("a b", ["a", "b"]), ("13,6,3", ["13", "6", "3"])])
def test_comma_list_items(text, want):
    assert comma_list(text, "--x") == want


@pytest.mark.parametrize("text", ["13,,6", "a,", ",a", " , ", "a,, b"])
def test_comma_list_refuses_an_empty_item(text):
    with pytest.raises(ValueError, match=r"--users has an empty item|--users is empty"):
        comma_list(text, "--users")


def test_comma_list_refuses_empty_and_non_strings():
    with pytest.raises(ValueError, match="--modes is empty"):
        comma_list("", "--modes")
    with pytest.raises(ValueError, match="--modes must be a comma-separated list"):
        comma_list(None, "--modes")


def test_every_list_argument_refuses_an_empty_item(capsys):
    """The call sites: step_profile's users, the needle runner's modes and GPUs, serve-bench's modes and rates, the
    fidelity and key-bias command lines (argparse exits 2 with the message)."""
    with pytest.raises(ValueError, match="users has an empty item"):
        profile.parse_users("13,,6")
    with pytest.raises(ValueError, match="modes has an empty item"):
        accuracy_vllm.check_modes("bf16,,fp8")
    with pytest.raises(ValueError, match="gpus has an empty item"):
        accuracy_vllm.check_gpus("0,,1")
    with pytest.raises(ValueError, match="modes has an empty item"):
        servebench.check_config({"modes": "fp8,"})
    with pytest.raises(ValueError, match="request_rates has an empty item"):
        servebench.check_config({"request_rates": "1,,2"})
    from kvrepro import fidelity, keybias

    with pytest.raises(ValueError, match="--formats has an empty item"):
        fidelity.main(["cpu", "--formats", "bf16,,fp8", "--num-windows", "1", "--out", "/nonexistent/x.csv"])
    with pytest.raises(SystemExit):
        keybias.main(["--placements", "low,,high"])
    assert "--placements has an empty item" in capsys.readouterr().err
