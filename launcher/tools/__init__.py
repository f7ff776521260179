"""Tools around training runs: the sparsity sweep (``sweep`` runs the grid; ``sweep_report`` reports it from
``sweep_collect`` (reading the cells), ``sweep_fit`` (the power-law fit), ``sweep_analysis`` (intervals,
multipliers, paired differences), ``sweep_records`` (its CSV rows and JSON) and ``sweep_plots``) and Slurm
submission (``sbatch``; its hostlist helpers are :mod:`k2.parallel.hostlist`).
"""
