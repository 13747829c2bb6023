"""The benchmark and the paper-claim experiments (`./run.sh bench`): not imported by any algorithm.

spec.py       what a suite is made of: Config, Panel, Suite (imported by the two below)
suites.py     the suites: what is measured, every setting fixed before it runs
runner.py     the runs (resumable), the summaries, tables and plots, the command line
engines.py    rollout engines timed against each other (`python -m common.bench.engines`)
results/      the committed plots and tables the README shows
"""
