package gang

// Node pools: which pool each node, and so each slice's devices, is in, for
// the node_pool label of gpudra_class_devices (--node-pool-labels). A node
// relabelled moves only its own devices' counts.

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/tools/cache"
)

// NodePool is a node's pool: the value of the first of keys among its
// labels, "" when it has none of them.
func NodePool(labels map[string]string, keys []string) string {
	for _, k := range keys {
		if v, ok := labels[k]; ok {
			return v
		}
	}
	return ""
}

// setSliceNode records the node a slice is on ("": none, or the slice is
// gone).
func (c *classCounter) setSliceNode(uid types.UID, node string) {
	if old, ok := c.sliceNodes[uid]; ok {
		if c.nodeSlices[old].Delete(uid).Len() == 0 {
			delete(c.nodeSlices, old)
		}
		delete(c.sliceNodes, uid)
	}
	if node == "" {
		return
	}
	c.sliceNodes[uid] = node
	if c.nodeSlices[node] == nil {
		c.nodeSlices[node] = sets.New[types.UID]()
	}
	c.nodeSlices[node].Insert(uid)
}

// upsertNode records a node's pool; when it changed, the node's devices
// are counted in the new pool. It reports whether the counts changed.
func (c *classCounter) upsertNode(n *corev1.Node) bool {
	pool := NodePool(n.Labels, c.poolLabels)
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.nodePools[n.Name]; ok && old == pool {
		return false
	}
	return c.setNodePool(n.Name, pool)
}

func (c *classCounter) deleteNode(n *corev1.Node) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.nodePools[n.Name]; !ok {
		return false
	}
	changed := c.setNodePool(n.Name, "")
	delete(c.nodePools, n.Name)
	return changed
}

// setNodePool moves the node's devices to pool.
func (c *classCounter) setNodePool(node, pool string) bool {
	c.nodePools[node] = pool
	var keys []devKey
	for uid := range c.nodeSlices[node] {
		keys = append(keys, c.slices[uid]...)
	}
	if len(keys) == 0 {
		return false
	}
	c.change(keys, nil, func() {
		for _, k := range keys {
			if d := c.devices[k]; d != nil {
				d.pool = pool
			}
		}
	})
	return true
}

// nodeHandler feeds the counter the nodes' pools; changed is called when
// a node's pool moved devices between pools (the gauges are stale).
func (c *classCounter) nodeHandler(changed func()) cache.ResourceEventHandler {
	upsert := func(obj any) {
		if n, ok := obj.(*corev1.Node); ok && c.upsertNode(n) {
			changed()
		}
	}
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    upsert,
		UpdateFunc: func(_, obj any) { upsert(obj) },
		DeleteFunc: func(obj any) {
			if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = t.Obj
			}
			if n, ok := obj.(*corev1.Node); ok && c.deleteNode(n) {
				changed()
			}
		},
	}
}
