"""What a person reads of a run: scores, the views of attention, AER, attention files, heatmaps, TensorBoard,
the explorer, the comparison of runs; one pass over a split builds what each of them reads."""
