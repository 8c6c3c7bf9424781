"""TransServer: timestamps, transactions, HWM, safe GC timestamp and the query gate."""
