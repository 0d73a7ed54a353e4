import importlib

from opsnn_lab.bench import __main__ as bench_main


def test_every_listed_benchmark_has_a_main():
    # `python -m opsnn_lab.bench all` (make bench) calls main() on each of these in turn
    names = bench_main.available()
    assert {"ops", "e2e", "consistency", "fusion"} <= set(names)
    for name in names:
        assert callable(getattr(importlib.import_module(f"opsnn_lab.bench.{name}"), "main", None)), name


def test_usage_lists_the_benchmarks_and_an_unknown_name_is_refused(capsys):
    assert bench_main.main([]) == 2
    assert "all" in capsys.readouterr().out
    assert bench_main.main(["allocator"]) == 2
    assert "unknown benchmark 'allocator'" in capsys.readouterr().err
