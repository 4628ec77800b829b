"""`python -m gpufleet`: the fab program (gpufleet/tasks.py), where its console scripts are
not on PATH."""

from gpufleet.tasks import main

main()
