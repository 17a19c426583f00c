"""`qerl report`: every result the workflow wrote, side by side with the paper's numbers
(results/reference/paper.csv), as tables, figures and one flat file of values that
`qerl report --check` compares with expected values."""
