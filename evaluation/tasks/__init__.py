"""The lm-eval task folder of switchhead: LAMBADA, BLiMP, CBT and WikiText read from local files.

Use it with `lm-eval run --include_path <this folder> --tasks switchhead_lambada ...`, or through
`switchhead eval`. `utils.py` (the `!function` module of the YAML files) says where data files are looked up.
"""
