package controller

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	gpudrav1 "github.com/gpudra/gpudra/api/gpudra/v1alpha1"
	"github.com/gpudra/gpudra/pkg/webhook"
)

// gangMemberIndex indexes gang pods by "<namespace>/<gang>".
const gangMemberIndex = "gang"

// watchGangMembers keeps, on every replica (each one serves the webhook),
// the pods of gangs: one informer per gang label (gpudra.dev/gang, Grove's
// grove.io/podgang), so that no other pod is listed or kept, and of each pod
// only what the webhook's priority check reads. Until the informers have
// synced a gang looks empty: its pods are admitted unchecked, and the gang
// controller holds back a gang whose pods differ all the same.
func watchGangMembers(ctx context.Context, client kubernetes.Interface) webhook.GangMembers {
	var indexers []cache.Indexer
	for _, label := range []string{gpudrav1.LabelGang, webhook.LabelGrovePodGang} {
		inf := coreinformers.NewFilteredPodInformer(client, metav1.NamespaceAll, 0,
			cache.Indexers{gangMemberIndex: gangMemberKey(label)},
			func(o *metav1.ListOptions) { o.LabelSelector = label })
		_ = inf.SetTransform(slimGangMember)
		go inf.Run(ctx.Done())
		indexers = append(indexers, inf.GetIndexer())
	}
	return func(namespace, gang string) []*corev1.Pod {
		var pods []*corev1.Pod
		for _, idx := range indexers {
			objs, err := idx.ByIndex(gangMemberIndex, namespace+"/"+gang)
			if err != nil {
				continue
			}
			for _, o := range objs {
				pods = append(pods, o.(*corev1.Pod))
			}
		}
		return pods
	}
}

// gangMemberKey indexes a pod of the informer for label under its gang,
// when that label names it (a pod that carries both is gpudra.dev/gang's,
// as webhook.PodGroupName says, and is listed once).
func gangMemberKey(label string) cache.IndexFunc {
	return func(obj any) ([]string, error) {
		p, ok := obj.(*corev1.Pod)
		if !ok {
			return nil, nil
		}
		gang := webhook.PodGroupName(p)
		if gang == "" || p.Labels[label] != gang || (label != gpudrav1.LabelGang && p.Labels[gpudrav1.LabelGang] != "") {
			return nil, nil
		}
		return []string{p.Namespace + "/" + gang}, nil
	}
}

// slimGangMember keeps of a pod what the priority check reads.
func slimGangMember(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	labels := map[string]string{}
	for _, l := range []string{gpudrav1.LabelGang, webhook.LabelGrovePodGang} {
		if v, ok := p.Labels[l]; ok {
			labels[l] = v
		}
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: p.Name, Namespace: p.Namespace, UID: p.UID, ResourceVersion: p.ResourceVersion,
			Labels: labels, CreationTimestamp: p.CreationTimestamp, DeletionTimestamp: p.DeletionTimestamp},
		Spec:   corev1.PodSpec{Priority: p.Spec.Priority, PriorityClassName: p.Spec.PriorityClassName, SchedulerName: p.Spec.SchedulerName},
		Status: corev1.PodStatus{Phase: p.Status.Phase},
	}, nil
}

// podGroupGang answers the webhook's PodGroupGang with a Get of the
// PodGroup (the controller may get PodGroups, and only pods that name a
// scheduling group ask): the gang its label gpudra.dev/gang names, "" for
// a PodGroup that is not gpudra-controller's or does not exist.
func podGroupGang(client kubernetes.Interface) webhook.PodGroupGang {
	return func(ctx context.Context, namespace, name string) (string, error) {
		pg, err := client.SchedulingV1beta1().PodGroups(namespace).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return "", nil
		}
		if err != nil {
			return "", err
		}
		return pg.Labels[gpudrav1.LabelGang], nil
	}
}
