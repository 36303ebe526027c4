"""Scale-out: the sharding plan (tensor / data parallel) and multi-host initialisation."""
