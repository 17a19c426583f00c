"""`qerl report`: every result the workflow wrote, side by side with the paper's numbers
(qerl/report/paper.csv, with the band within which each counts as reproduced), as tables,
figures and one flat file of values that `qerl report --check` compares with expected values
(qerl/report/expected.py) and `--check-paper` with the paper's."""
