package dashboard

import (
	"context"
	"fmt"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"

	"github.com/gpudra/gpudra/pkg/kubeclient"
)

// watchEngines watches the engines' resources the Workloads tab groups pods
// by (KubeRay's RayClusters and RayJobs, Kueue's Workloads and
// LocalQueues; workloads.go) where each is served, with watch (Run's: it
// adds the informer to those synced and rebuilds on its changes), and
// returns their factories to start and the notes of what could not be
// told or read.
func (s *ClusterSource) watchEngines(ctx context.Context, st *clusterStores, watch func(cache.SharedIndexInformer) cache.Store) ([]dynamicinformer.DynamicSharedInformerFactory, []string) {
	if s.cfg.Dynamic == nil {
		return nil, nil
	}
	var factories []dynamicinformer.DynamicSharedInformerFactory
	var notes []string
	for _, e := range []struct {
		what  string
		gvr   schema.GroupVersionResource
		into  *[]cache.Store
		hides string
	}{
		{"RayClusters", RayClusters, &st.rayClusters, "Ray clusters are not shown as such"},
		{"RayJobs", RayJobs, &st.rayJobs, "RayJobs are not shown as such"},
		{"Kueue Workloads", KueueWorkloads, &st.kueueWorkloads, "Kueue's admission and reasons are not shown"},
		{"Kueue LocalQueues", LocalQueues, &st.localQueues, "a pending Kueue workload shows no ClusterQueue"},
	} {
		ns, note := s.engineScope(ctx, e.what, e.gvr)
		if note != "" {
			notes = append(notes, note+": "+e.hides)
		}
		if ns == nil {
			continue
		}
		f := dynamicinformer.NewFilteredDynamicSharedInformerFactory(s.cfg.Dynamic, 0, *ns, nil)
		factories = append(factories, f)
		*e.into = append(*e.into, watch(f.ForResource(e.gvr).Informer()))
	}
	return factories, notes
}

// engineScope says where an engine's resource (KubeRay's, Kueue's) can
// be watched: nil when it cannot. Each is optional: one the cluster does
// not serve (discovery says 404, or its group lacks it) is left out
// without a note, since most clusters run neither engine; discovery that
// failed otherwise is a note that it could not tell, never "absent".
// Where it is served, it is read in the namespace asked, else in every
// namespace, falling back to the context's as pods are.
func (s *ClusterSource) engineScope(ctx context.Context, what string, gvr schema.GroupVersionResource) (*string, string) {
	served, err := kubeclient.ResourceServed(s.cfg.Client.Discovery(), gvr)
	switch {
	case err != nil:
		return nil, fmt.Sprintf("%s: could not tell whether %s is served (%v)", what, gvr.GroupVersion(), err)
	case !served:
		return nil, ""
	}
	list := func(ns string) func(context.Context, metav1.ListOptions) error {
		return func(ctx context.Context, o metav1.ListOptions) error {
			_, err := s.cfg.Dynamic.Resource(gvr).Namespace(ns).List(ctx, o)
			return err
		}
	}
	ns := s.cfg.Namespace
	ok, note := watchable(ctx, what, scopeOf(ns), list(ns))
	if !ok && ns == "" && s.cfg.FallbackNamespace != "" {
		// As pods are: the context's namespace (the pods' note says so).
		if ok2, _ := watchable(ctx, what, "", list(s.cfg.FallbackNamespace)); ok2 {
			ns, ok = s.cfg.FallbackNamespace, true
		}
	}
	if !ok {
		return nil, note
	}
	return &ns, ""
}
