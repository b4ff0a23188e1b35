"""A smoke run of bench/detokenize.py: both methods give the whole decode's text (the bench exits otherwise)."""

from bench.detokenize import main


def test_both_methods_give_the_same_text(capsys):
    assert main(["--lengths", "40,200", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["40", "200"] and all(row[3].endswith("x") for row in rows)
