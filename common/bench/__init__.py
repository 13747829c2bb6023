"""The benchmark and the paper-claim experiments (`./run.sh bench`): not imported by any algorithm.

runner.py     the suites, the runs (resumable), the summaries, tables and plots
engines.py    rollout engines timed against each other (`python -m common.bench.engines`)
results/      the committed plots and tables the README shows
"""
