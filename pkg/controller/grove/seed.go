package grove

import (
	"context"
	"fmt"
	"slices"
	"time"

	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
)

// seed reads the Events an earlier leader recorded on claims, so that a
// new leader does not report the same problems again: for each claim and
// reason the latest note counts as reported. A problem whose message
// changed meanwhile is reported again, as it would have been.
func (c *Controller) seed(ctx context.Context) error {
	list, err := c.opts.Client.EventsV1().Events(metav1.NamespaceAll).List(ctx, metav1.ListOptions{
		FieldSelector: "regarding.kind=ResourceClaim",
	})
	if err != nil {
		return fmt.Errorf("list Events: %w", err)
	}
	latest := map[string]*eventsv1.Event{}
	for i := range list.Items {
		e := &list.Items[i]
		if e.Regarding.Kind != "ResourceClaim" || e.Action != ActionShare || !slices.Contains(Reasons, e.Reason) {
			continue
		}
		k := string(e.Regarding.UID) + "/" + e.Reason
		if old := latest[k]; old == nil || eventTime(e).After(eventTime(old)) {
			latest[k] = e
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range latest {
		key := e.Regarding.Namespace + "/" + e.Regarding.Name
		st := c.groups[key]
		if st == nil || st.uid != e.Regarding.UID {
			st = &groupState{uid: e.Regarding.UID, reported: map[string]reported{}}
			c.groups[key] = st
		}
		st.reported[e.Reason] = reported{message: e.Note}
	}
	klog.FromContext(ctx).V(2).Info("Read earlier Events", "problems", len(latest))
	return nil
}

func eventTime(e *eventsv1.Event) time.Time {
	if e.Series != nil {
		return e.Series.LastObservedTime.Time
	}
	if !e.EventTime.IsZero() {
		return e.EventTime.Time
	}
	return e.CreationTimestamp.Time
}
