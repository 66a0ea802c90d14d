"""`launch/bench_scan.py`: both variants compile, give the same loss, and every length gets its row."""

from ember.launch import bench_scan


def test_every_length_gets_a_row_of_both_variants(tmp_path, capsys):
    out = tmp_path / "B.md"
    bench_scan.main(["--lengths", "2,3", "--width", "8", "--batch", "2", "--calls", "1", "--markdown", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 2 |") or line.startswith("| 3 |")]
    assert len(rows) == 2 and all(row.count("|") == 9 for row in rows), out.read_text()
    assert capsys.readouterr().out.strip().endswith(rows[-1])
