"""Judge service: GenAcc, EM and F1 (POST /judge)."""
