package gang

import (
	"time"

	corev1 "k8s.io/api/core/v1"
)

// The informers lag behind the controller's own writes, and a round must
// not plan, release, hand over or re-queue again from a stale view what the
// controller just did. Controller.recent remembers those writes for
// recentTTL, in one map of four kinds of key, each written and read only
// through its own pair of helpers below:
//
//   - an item admitted (rememberAdmitted, justAdmitted): the item's key,
//     "GpuReservation/<namespace>/<name>" or "Gang/<namespace>/<name>";
//   - a gang pod whose gate was lifted (rememberReleased, justReleased):
//     "pod/<uid>";
//   - a gang's PodGroup made (rememberPodGroup, podGroupJustMade):
//     "podgroup/<namespace>/<name>";
//   - a held reservation queued again by the repair (rememberRequeued,
//     justRequeued): "requeued/<namespace>/<name>".
//
// Any entry younger than recentTTL also keeps the controller from idling
// (settled).

// recentTTL bounds how long the informers may lag behind the
// controller's own writes.
const recentTTL = 30 * time.Second

// rememberAdmitted records that an item (by its key) was just admitted.
func (c *Controller) rememberAdmitted(itemKey string) { c.remember(itemKey) }

// justAdmitted says whether an item (by its key) was admitted within
// recentTTL.
func (c *Controller) justAdmitted(itemKey string) bool { return c.isRecent(itemKey) }

// rememberReleased records that this controller just lifted the pod's gate.
func (c *Controller) rememberReleased(p *corev1.Pod) { c.remember("pod/" + string(p.UID)) }

// justReleased says whether this controller just lifted the pod's gate (the
// informer has not seen it yet).
func (c *Controller) justReleased(p *corev1.Pod) bool { return c.isRecent("pod/" + string(p.UID)) }

// rememberPodGroup records that this controller just made a gang's
// PodGroup.
func (c *Controller) rememberPodGroup(namespace, name string) {
	c.remember("podgroup/" + namespace + "/" + name)
}

// podGroupJustMade says whether this controller made a gang's PodGroup
// within recentTTL (the informer may not show it yet).
func (c *Controller) podGroupJustMade(namespace, name string) bool {
	return c.isRecent("podgroup/" + namespace + "/" + name)
}

// rememberRequeued records that the repair just queued a held reservation
// again.
func (c *Controller) rememberRequeued(namespace, name string) {
	c.remember("requeued/" + namespace + "/" + name)
}

// justRequeued says whether the repair queued a held reservation again
// within recentTTL (the informer may still show it Held).
func (c *Controller) justRequeued(namespace, name string) bool {
	return c.isRecent("requeued/" + namespace + "/" + name)
}

// remember records a key as just written; use the helpers above.
func (c *Controller) remember(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.recent[key] = c.opts.Now()
}

// isRecent says whether key was written within recentTTL, and forgets
// older entries; use the helpers above.
func (c *Controller) isRecent(key string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.forgetOldLocked(c.opts.Now())
	_, ok := c.recent[key]
	return ok
}

// forgetOldLocked forgets the entries older than recentTTL; c.mu is held.
func (c *Controller) forgetOldLocked(now time.Time) {
	for k, t := range c.recent {
		if now.Sub(t) > recentTTL {
			delete(c.recent, k)
		}
	}
}
