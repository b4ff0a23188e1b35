from bench.mesh import rotated


def test_each_configuration_takes_every_place_in_the_order_equally_often():
    names = ["engine", "local", "mesh", "mesh-against"]
    orders = [rotated(names, i) for i in range(8)]
    assert orders[0] == names and orders[1] == ["local", "mesh", "mesh-against", "engine"]
    for place in range(len(names)):
        assert sorted(order[place] for order in orders) == sorted(names * 2)
    assert all(sorted(order) == sorted(names) for order in orders)
