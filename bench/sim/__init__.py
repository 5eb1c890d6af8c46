"""The swarm simulator behind ``bench/simulate.py``: the project's own decisions (stage choice, rebalancing, the
rounds' grids and group checks, routing, read cadences, checkpoint writers and placement) on a simulated clock,
population, DHT and network. One module per simulated part: :mod:`.world` (peers, links, records), :mod:`.rounds`,
:mod:`.route`, :mod:`.checkpoints`, :mod:`.dht` (traffic), :mod:`.run` (the clock)."""
