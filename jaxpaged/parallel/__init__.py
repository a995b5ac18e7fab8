"""Scale: tensor parallelism over local devices (`tensor_parallel`) and several processes (`multihost`)."""
